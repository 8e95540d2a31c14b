"""The `nanovllm` command (pyproject's console script): `nanovllm run-batch ...`."""
import argparse
import sys

from nanovllm.entrypoints import run_batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nanovllm")
    commands = parser.add_subparsers(dest="command", required=True)
    run_batch.add_arguments(commands.add_parser("run-batch", help="an OpenAI batch file through one LLM",
                                                description=run_batch.__doc__,
                                                formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    return run_batch.run(args)


if __name__ == "__main__":
    sys.exit(main())
