"""Where a layer's time goes inside the one-kernel bs=1 decode step (csrc/decode_layers.cu): every CTA stamps
globaltimer at its phases (Params.stamps); this prints, per phase, the median and the latest CTA relative to the
moment the layer's input was complete (the last DOWN tile of the layer before), averaged over the middle layers.

    python scripts/decode_layers_phases.py [--model qwen3-0.6b] [--context 576]
"""
import argparse
import os
import random
import tempfile

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.weights.synthetic import write_model

GEMV = ("qkv", "o", "gate_up", "down")
GEMV_EVENTS = ("wait begins", "input published", "input staged", "tiles done")
ATTN_EVENTS = ("begins", "qkv published", "k/v landed", "partial written", "counted", "merged + published")


def names() -> dict[int, str]:
    out = {4 * j + e: f"{stage} {what}" for j, stage in enumerate(GEMV) for e, what in enumerate(GEMV_EVENTS)}
    out |= {16 + e: f"attention {what}" for e, what in enumerate(ATTN_EVENTS)}
    out |= {22 + j: f"producer issues {stage}" for j, stage in enumerate(GEMV)}
    out[26] = "producer issued k/v"
    out |= {27 + j: f"{stage} first tile landed" for j, stage in enumerate(GEMV)}
    out |= {31 + j: f"{stage} first tile done" for j, stage in enumerate(GEMV)}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--context", type=int, default=576)
    args = ap.parse_args()
    os.environ["NANOVLLM_DECODE_LAYERS"] = "1"
    path = write_model(args.model, tempfile.mkdtemp(), torch.bfloat16)
    llm = LLM(str(path), device="cuda", dtype=torch.bfloat16, enforce_eager=True, max_num_seqs=1, max_model_len=1024,
              enable_prefix_caching=False)
    kernel = llm.llm_engine.model_runner.model.model.decode_layers
    assert kernel is not None, "the one-kernel path is off"
    layers = kernel.params.num_layers
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kernel.stamps = torch.zeros(sms, layers, 2, 48, dtype=torch.int64, device="cuda")
    prompt = [random.Random(0).randint(100, 20000) for _ in range(args.context - 64)]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=65, ignore_eos=True), use_tqdm=False)
    s = kernel.stamps[:, :, 0].cpu().double() / 1000  # us (globaltimer)
    c = kernel.stamps[:, :, 1].cpu().double()  # SM cycles (clock64)
    ready = s[:, :, 15].amax(0)  # [layers]: the last DOWN tile of each layer
    period = (ready[2:-1] - ready[1:-2]).mean().item()
    print(f"{args.model}, context {args.context}, {sms} CTAs: {period:.2f} us a layer (layers 2..{layers - 2})")
    print("| phase | median CTA us | latest CTA us |\n|---|---|---|")
    rows = []
    for event, name in names().items():
        meds, maxes = [], []
        for layer in range(2, layers - 1):
            col = s[:, layer, event]
            col = col[col > 0] - ready[layer - 1]
            if col.numel():
                meds.append(col.median().item())
                maxes.append(col.max().item())
        if meds:
            rows.append((sum(meds) / len(meds), sum(maxes) / len(maxes), name))
    for med, late, name in sorted(rows):
        print(f"| {name} | {med:.2f} | {late:.2f} |")
    # within a CTA: clock64 spans between phases (exact; globaltimer can tick coarsely)
    mid = slice(2, layers - 1)
    span_ns = s[:, mid, 15] - s[:, mid, 0]
    span_cycles = c[:, mid, 15] - c[:, mid, 0]
    ok = (span_ns > 5) & (span_cycles > 0)
    ghz = (span_cycles[ok].sum() / span_ns[ok].sum()).item() / 1000
    print(f"\nSM clock {ghz * 1000:.0f} MHz; median spans inside a CTA (clock64), us")
    spans = [(0, 1), (1, 2), (2, 27), (27, 31), (31, 3), (16, 17), (17, 18), (18, 19), (19, 20), (20, 21),
             (4, 5), (5, 6), (6, 28), (28, 32), (32, 7), (8, 9), (9, 10), (10, 29), (29, 33), (33, 11),
             (12, 13), (13, 14), (14, 30), (30, 34), (34, 15)]
    label = names()
    for a, b in spans:
        d = (c[:, mid, b] - c[:, mid, a])
        d = d[(c[:, mid, a] > 0) & (c[:, mid, b] > 0)]
        if d.numel():
            print(f"| {label[a]} -> {label[b]} | {d.median().item() / ghz / 1000:.2f} |")


if __name__ == "__main__":
    main()
