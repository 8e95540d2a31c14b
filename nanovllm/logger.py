import logging

logger = logging.getLogger("nanovllm")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s nanovllm: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

_said: set[str] = set()


def log_once(message: str, level: int = logging.INFO):
    """Log a message (a chosen path, a fallback) only the first time it is said in this process."""
    if message not in _said:
        _said.add(message)
        logger.log(level, message)
