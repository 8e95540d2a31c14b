import importlib

# HF `architectures` name -> (module under nanovllm.models, class name)
_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen3_moe", "Qwen2MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("qwen3_next", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_next", "Qwen3_5ForCausalLM"),
}
# a vision-language checkpoint whose language model runs as this text architecture (its vision tower is not loaded)
TEXT_ONLY = {"Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
             "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM"}
# GGUF `general.architecture` -> HF architecture
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM",
                      # weights/gguf_hybrid.py: all three in Qwen3.5's layout
                      "qwen3next": "Qwen3_5MoeForCausalLM", "qwen35": "Qwen3_5MoeForCausalLM",
                      "qwen35moe": "Qwen3_5MoeForCausalLM"}


def supported_architectures() -> list[str]:
    return sorted([*_MODELS, *TEXT_ONLY])


def text_config(hf_config):
    """The config of the model to run: a vision-language checkpoint's text config under its text architecture."""
    names = getattr(hf_config, "architectures", None) or []
    if names and names[0] in TEXT_ONLY and getattr(hf_config, "text_config", None) is not None:
        text = hf_config.text_config
        text.architectures = [TEXT_ONLY[names[0]]]
        return text
    return hf_config


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
