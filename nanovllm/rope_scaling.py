"""The rotary settings of an HF config, read the same way whatever the transformers version, and the context a
scaled rotary reaches: pure functions of the config, read by Config (max_model_len) and the rotary layer."""


def rope_parameters(hf_config) -> dict:
    """One dict for transformers 4 (rope_theta + rope_scaling) and 5 (rope_parameters)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    return params


def original_max_positions(p: dict, max_position: int) -> int:
    return p.get("original_max_position_embeddings") or max_position


def scaled_max_positions(p: dict, max_position: int) -> int:
    """The positions a scaled rotary reaches (vLLM's rule): the original context times `factor` for yarn, the
    config's max_position_embeddings times it for linear and dynamic; llama3 configs already state theirs."""
    kind = p["rope_type"]
    if kind == "yarn":
        return int(original_max_positions(p, max_position) * p["factor"])
    if kind in ("linear", "dynamic"):
        return int(max_position * p["factor"])
    return max_position
