import importlib

# HF `architectures` name -> (module under nanovllm.models, class name)
_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen3_moe", "Qwen2MoeForCausalLM"),
}
# GGUF `general.architecture` -> HF architecture
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM"}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(hf_config) -> str:
    names = getattr(hf_config, "architectures", None) or []
    for name in names:
        if name in _MODELS:
            return name
    raise ValueError(f"unsupported model architecture {names or '(none given)'}; "
                     f"nanovllm supports {', '.join(supported_architectures())} "
                     f"(GGUF: {', '.join(sorted(GGUF_ARCHITECTURES))})")


def get_model_class(hf_config):
    module, cls = _MODELS[resolve_architecture(hf_config)]
    return getattr(importlib.import_module(f"nanovllm.models.{module}"), cls)
