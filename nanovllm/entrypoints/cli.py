"""The `nanovllm` command (pyproject's console script): `nanovllm run-batch ...`, `nanovllm serve MODEL ...`,
`nanovllm generate MODEL "prompt"`, `nanovllm chat MODEL`, `nanovllm lm-eval ...` (lm_eval's own command line)."""
import argparse
import sys

from nanovllm.entrypoints import interactive, run_batch
from nanovllm.entrypoints.engine_flags import add_engine_arguments


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["lm-eval"]:  # every flag after it is lm_eval's own
        from nanovllm.entrypoints.lm_eval import main as lm_eval_main  # lm-eval only where evaluated

        return lm_eval_main(argv[1:])
    parser = argparse.ArgumentParser(prog="nanovllm")
    commands = parser.add_subparsers(dest="command", required=True)
    run_batch.add_arguments(commands.add_parser("run-batch", help="an OpenAI batch file through one LLM",
                                                description=run_batch.__doc__,
                                                formatter_class=argparse.RawDescriptionHelpFormatter))
    serve = commands.add_parser("serve", help="the OpenAI API over one engine (HTTP)")
    serve.add_argument("model", help="an HF model directory or a GGUF file")
    serve.add_argument("--host", default=None, help="default: 127.0.0.1, or 0.0.0.0 with an API key")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="required as 'Authorization: Bearer KEY' (also NANOVLLM_API_KEY)")
    serve.add_argument("--served-model-name", default=None, help="the model name the API shows (default: MODEL)")
    add_engine_arguments(serve)
    interactive.add_arguments(commands.add_parser("generate", help="complete one prompt, printed as it is sampled"),
                              with_prompt=True)
    interactive.add_arguments(commands.add_parser("chat", help="a conversation in the terminal (empty line: end)"),
                              with_prompt=False)
    commands.add_parser("lm-eval", help="lm-evaluation-harness with --model nanovllm (lm_eval's flags follow)")
    args = parser.parse_args(argv)
    if args.command in ("generate", "chat"):
        return getattr(interactive, args.command)(args)
    if args.command == "serve":
        from nanovllm.entrypoints.openai.server import serve as run_server  # FastAPI only where served

        return run_server(args)
    return run_batch.run(args)


if __name__ == "__main__":
    sys.exit(main())
