"""Every engine argument as a command-line flag (--name-with-dashes, from Config's fields), for run-batch and serve."""
import argparse
import typing
from dataclasses import fields

from nanovllm.config import Config, engine_arg_names


def add_engine_arguments(parser: argparse.ArgumentParser):
    for field in fields(Config):  # None: LLM()'s default
        if field.init and field.name != "model":
            kind = _flag_type(field)
            parser.add_argument("--" + field.name.replace("_", "-"), default=None, help="as LLM()'s argument",
                                **({"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}))


def _flag_type(field) -> type:
    """bool, int, float or str: the first of those that a Config field's type (a union with None) names."""
    kinds = typing.get_args(field.type) or (field.type,)
    return next(kind for kind in (bool, int, float, str) if kind in kinds)


def engine_kwargs(args) -> dict:
    return {name: getattr(args, name) for name in engine_arg_names() if getattr(args, name) is not None}
