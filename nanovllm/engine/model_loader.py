"""The model on its device: built and loaded (its streamed decoder layers left in host memory or on disk), then its
linears and layers given the kernels the execution plan chose."""
import torch

from nanovllm.engine.plan import ExecutionPlan
from nanovllm.layers.custom_op import CustomOp
from nanovllm.layers.embed_head import LMHead
from nanovllm.layers.fused_moe import FusedMoE
from nanovllm.layers.linear import CpuPackedLinearMethod, LinearBase, UnquantizedLinearMethod
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.models import get_model_class
from nanovllm.quant.registry import get_quantization_config
from nanovllm.streaming.expert_offload import ExpertOffload
from nanovllm.streaming.layer_streamer import LayerStreamer
from nanovllm.streaming.placement import weights_do_not_fit
from nanovllm.weights.model_files import iterate_weights


def load_model(config, device: torch.device) -> tuple[torch.nn.Module, LayerStreamer | ExpertOffload | None]:
    """The loaded model and its layer or expert streamer (None: nothing streams). With streamed layers the model loads in host
    memory (quantized layers too), so the device need not hold it whole, even once; what stays resident moves to the
    device after."""
    mc = config.model_config
    quant_config = get_quantization_config(mc.quantization, device, mc.dtype, use_kernels=device.type == "cuda"
                                           and config.attention_backend != "torch")
    streams = bool(config.cpu_offload_gb or config.disk_offload_gb)
    build_on = torch.device("cpu") if streams else device
    if quant_config is not None and streams:
        quant_config.load_device = build_on
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    try:
        model = _build(mc, build_on, quant_config)
        model.load_weights(iterate_weights(mc, device))
        if quant_config is not None:
            quant_config.finish_loading(model)
        model.eval()
    except torch.OutOfMemoryError:  # raised below, once the half-built model is released
        model = None
    if model is None:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        raise weights_do_not_fit(mc, device, config.tensor_parallel_size, free)
    return model, _stream_layers(model, config, device) if streams else None


def _build(mc, device: torch.device, quant_config):
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(mc.dtype)
    try:
        with torch.device(device):
            return get_model_class(mc.hf_config)(mc.hf_config, quant_config)
    finally:
        torch.set_default_dtype(default_dtype)


def _stream_layers(model, config, device: torch.device) -> LayerStreamer | ExpertOffload:
    """A mixture of experts streams experts, any other model whole decoder layers."""
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    if moes:
        streamer = ExpertOffload.for_model(moes, config, device)
    else:
        streamer = LayerStreamer.for_layers(list(model.model.layers), device, config.cpu_offload_gb,
                                            config.disk_offload_gb, config.offload_folder)
    model.to(device)
    streamed = streamer.module_ids()
    for module in model.modules():  # quantized blocks are no module tensors: .to() leaves them
        if id(module) not in streamed and getattr(module, "qweights", None):
            module.qweights = [(offset, weight.to(device)) for offset, weight in module.qweights]
    return streamer


def apply_kernels(model, plan: ExecutionPlan, streamer: LayerStreamer | None):
    """The plan's linear method on every dense linear but the streamed layers' (their weights change place each step:
    F.linear reads them where they are), and the fused Triton layers where the plan runs them."""
    method = _linear_method(plan)
    streamed = streamer.module_ids() if streamer is not None else set()
    for module in model.modules():
        if method is not None and isinstance(module, (LinearBase, LMHead)) and id(module) not in streamed \
                and type(module.linear_method) is UnquantizedLinearMethod:
            module.linear_method = method()
            module.linear_method.process_weights_after_loading(module)
        if isinstance(module, CustomOp):
            module.use_triton = plan.fast_kernels
        if plan.fast_kernels and isinstance(module, RotaryEmbedding):
            module.tables(plan.dtype)  # cast now, never inside a CUDA graph capture


def _linear_method(plan: ExecutionPlan):
    if plan.linear_method == "onednn":
        return CpuPackedLinearMethod
    if plan.linear_method == "gemv":
        from nanovllm.kernels import gemv_one_row
        from nanovllm.layers.gemv_linear import TritonGemvLinearMethod

        gemv_one_row.why_off(plan.device)  # builds the one-row kernel now (not in a graph capture), logs the path
        return TritonGemvLinearMethod
    return None
