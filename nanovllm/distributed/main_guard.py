"""Worker processes start by spawn, which runs the main script's top level again in each of them: a script that builds
LLM(tensor_parallel_size / data_parallel_size > 1) outside `if __name__ == "__main__":` would build it again there.
Both ends refuse it at once, naming the fix: the parent before it starts a process, the child while it imports."""
import ast
import multiprocessing
import sys

MESSAGE = ("{setting} starts worker processes, which run your script's top level again: put the code that builds "
           "LLM(...) under `if __name__ == \"__main__\":`")


def require_main_guard(setting: str):
    """Raise where the main script is running top-level code outside `if __name__ == "__main__":` that led here, or
    where this process is a spawned worker still importing that script."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(MESSAGE.format(setting=setting))
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    line = _top_level_line(main)
    if path is None or line is None:
        return  # an interactive session or a notebook: spawn does not run it again
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return
    if not any(_is_main_guard(node) and node.lineno <= line <= node.end_lineno for node in tree.body):
        raise RuntimeError(MESSAGE.format(setting=setting))


def _top_level_line(main) -> int | None:
    """The line of the main module's top level that is running now (its outermost frame)."""
    line, frame = None, sys._getframe()
    while frame is not None:
        if main is not None and frame.f_globals is vars(main) and frame.f_code.co_name == "<module>":
            line = frame.f_lineno
        frame = frame.f_back
    return line


def _is_main_guard(node: ast.stmt) -> bool:
    """`if __name__ == "__main__":` (either side)."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare) or len(node.test.comparators) != 1:
        return False
    sides = {ast.dump(node.test.left), ast.dump(node.test.comparators[0])}
    return isinstance(node.test.ops[0], ast.Eq) and sides == {ast.dump(ast.Name("__name__", ast.Load())),
                                                               ast.dump(ast.Constant("__main__"))}
