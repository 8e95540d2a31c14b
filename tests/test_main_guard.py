"""tensor_parallel_size / data_parallel_size start worker processes by spawn, which runs the script's top level again:
a script that builds LLM(...) outside `if __name__ == "__main__":` stops at once with an error that says so, before
any model is read; a guarded one is let through."""
import subprocess
import sys

import pytest

SCRIPTS = {
    "top level": 'from nanovllm import LLM\nllm = LLM("no-such-model", {setting}=2)\n',
    "a function called at top level": 'from nanovllm import LLM\n\ndef main():\n    LLM("no-such-model", {setting}=2)\n\n'
                                      'main()\n',
    "guarded": 'from nanovllm import LLM\n\nif __name__ == "__main__":\n    LLM("no-such-model", {setting}=2)\n',
    "guarded, the other way round": 'from nanovllm import LLM\n\nif "__main__" == __name__:\n'
                                    '    LLM("no-such-model", {setting}=2)\n',
}


@pytest.mark.parametrize("setting", ["tensor_parallel_size", "data_parallel_size"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_an_unguarded_script_is_refused_before_any_work(tmp_path, script, setting):
    path = tmp_path / "script.py"
    path.write_text(SCRIPTS[script].format(setting=setting))
    result = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    refused = f'{setting}=2 starts worker processes, which run your script\'s top level again: put the code that ' \
              'builds LLM(...) under `if __name__ == "__main__":`'
    if script.startswith("guarded"):  # let through to the model path, which does not exist
        assert refused not in result.stderr and "no-such-model" in result.stderr
    else:
        assert refused in result.stderr
