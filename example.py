"""Chat with the bundled real model (SmolLM2-135M-Instruct, GGUF) on the GPU if there is one, else the CPU.

    python example.py [--model PATH] [--device auto|cpu|cuda]
"""
import argparse
import time

from nanovllm import LLM, SamplingParams
from nanovllm.weights.bundled import bundled_model_path

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a GPU is in one sentence.",
    "Give me three tips for learning a new language.",
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file or a HF model directory (default: the bundled SmolLM2)")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    llm = LLM(args.model or bundled_model_path(), device=args.device)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0.6, top_p=0.95, max_tokens=128, seed=0)
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    seconds = time.perf_counter() - start
    for question, out in zip(QUESTIONS, outputs):
        print(f"\nPrompt: {question}\nAnswer: {out.outputs[0].text.strip()}")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{generated} tokens in {seconds:.2f} s: {generated / seconds:.1f} output tok/s "
          f"on {llm.llm_engine.config.device} ({len(outputs)} requests in one batch)")


if __name__ == "__main__":
    main()
