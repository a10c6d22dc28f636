"""The README's Python example runs as written, on the fixtures."""

import re
import shutil

import numpy as np

from conftest import FIXTURES, ROOT


def test_the_readme_example_runs(tmp_path, monkeypatch, capsys):
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## From Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    # The example's files, made of the fixtures: a GPT-2 folder, a 7B config, a token file.
    shutil.copytree(FIXTURES / "gpt2_lm", tmp_path / "gpt2")
    (tmp_path / "llama-7b").mkdir()
    shutil.copy(ROOT / "assets" / "configs" / "llama-2-7b.json",
                tmp_path / "llama-7b" / "config.json")
    np.random.default_rng(0).integers(0, 99, 8192).astype(np.uint16).tofile(tmp_path / "train.bin")
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["info"].family == "gpt2"
    assert scope["plan"].converted > 0
    # The example's glob shows a real decision: a product and what it accumulates in.
    assert any(d.op_class == "contraction" and d.accumulates == "f32"
               for d in scope["plan"].explain("h.0.attn.qkv*"))
    assert scope["weights"]["transformer.wte.weight"].shape == (99, 32)
    assert scope["step"].anatomy["total"] > 10 * 2**30
    assert scope["out"]["logits"].shape == (1, 5, 99)
    assert scope["run"].steps_done == 20
    assert (tmp_path / "out" / "model.safetensors").is_file()
