"""The README stays true: its API example runs as written (on the bundled model, fewer new tokens)."""
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # loads the real model

README = Path(__file__).resolve().parent.parent / "README.md"


def test_api_example_runs():
    block = re.search(r"## API\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    names = {}
    exec(block.replace("max_tokens=64", "max_tokens=8"), names)
    assert len(names["outputs"]) == 2 and all(o.outputs[0].token_ids for o in names["outputs"])
    assert names["total"] < 0 and names["answers"][0].outputs[0].text
