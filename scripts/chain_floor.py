"""bs=1 decode (bench.py decode1, Qwen3-0.6B shape) with every decoder layer reading layer 0's weights (31.5 MB:
they stay in L2): the layer chain's latency when weight bytes cost (almost) nothing; and with the first N layers
only, so that two runs give a layer's time (the slope) and the rest of a step (the intercept).
    python scripts/chain_floor.py base|alias|attn|mlp [N]
base: the model as it is; alias: every layer's weights are layer 0's; attn / mlp: only those weights aliased."""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench  # noqa: E402
from nanovllm.engine import model_runner as mr  # noqa: E402

mode = sys.argv[1]
keep = int(sys.argv[2]) if len(sys.argv) > 2 else None
orig = mr.ModelRunner._load_model


def aliased(self):
    model = orig(self)
    layers = model.model.layers
    if keep is not None:
        del layers[keep:]
    first = dict(layers[0].named_parameters())
    for layer in layers[1:]:
        for name, p in layer.named_parameters():
            if mode == "alias" or (mode == "attn" and "self_attn" in name) or (mode == "mlp" and "mlp" in name):
                p.data = first[name].data
    return model


mr.ModelRunner._load_model = aliased
args = argparse.Namespace(mode="decode1", device="cuda", attention_backend=None, enforce_eager=False, model="qwen3-0.6b",
                          repeat=3)
model = bench.resolve_model("qwen3-0.6b", torch.bfloat16)
print("mode", mode, "layers", keep or "all")
bench.bench_decode1(args, model, torch.bfloat16)
