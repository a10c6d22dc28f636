"""The Python API against the fixtures' PyTorch outputs and against the CLI it shares its
implementation with."""

import json
import os
import re
import signal
import threading
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

import castor
from conftest import FIXTURES, ROOT, cli

# Every family fixture (tests/common/mod.rs, VARIANTS).
VARIANTS = [
    "gpt2_lm", "gpt2_base", "bert_base", "bert_mlm", "llama_gqa", "llama_tied", "qwen2_bias",
    "mistral_window", "gemma_tiny", "llama31_rope", "bert_cls", "bert_reg", "llama_cls",
    "qwen2_cls",
]
TINY_GPT2 = ROOT / "assets" / "tiny-gpt2.json"
CORPUS = ROOT / "assets" / "corpus.txt"


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


# ---- inspect ----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_inspect_reads_every_family(variant):
    path = FIXTURES / variant
    info = castor.inspect(path)
    config = json.loads((path / "config.json").read_text())
    assert info.family == config["model_type"]
    assert info.config == config
    assert info.architecture in info.summary
    files = sorted(path.glob("*.safetensors"))
    files = [f for f in files if f.name.startswith("model")]
    assert info.files == [str(f) for f in files]
    assert stored_dtypes(files[0]) == {info.dtype.upper()}
    # The summary is the CLI's report, and its parameter count is the one the CLI prints.
    assert info.summary == cli("inspect", path).stdout
    assert f"parameters  {info.num_parameters:,}" in info.summary
    assert f"stored {info.dtype};" in info.summary


def stored_dtypes(file):
    """The dtypes in a safetensors header."""
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    return {v["dtype"] for k, v in header.items()
            if k != "__metadata__" and v["dtype"].startswith(("F", "BF"))}


def test_inspect_reads_a_bare_config():
    info = castor.inspect(ROOT / "assets" / "configs" / "llama-2-7b.json")
    assert info.family == "llama"
    assert info.files == [] and info.dtype is None
    assert 6.7e9 < info.num_parameters < 6.8e9


# ---- compile ----------------------------------------------------------------------------------

HEADLINE = re.compile(r"converted (\d+)/(\d+) nodes to \S+ with (\d+) casts?")


@pytest.mark.parametrize("variant", ["gpt2_lm", "bert_base", "llama_gqa"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_compile_reports_what_the_cli_reports(variant, precision):
    path = FIXTURES / variant
    plan = castor.compile(path, precision, seq=8, keep_f32=["*norm*"] if variant == "llama_gqa"
                          else ())
    flags = ["--keep-f32", "*norm*"] if variant == "llama_gqa" else []
    out = cli("compile", path, "--precision", precision, "--seq", "8", *flags).stdout
    assert plan.summary == out
    converted, total, casts = map(int, HEADLINE.search(out).groups())
    assert (plan.converted, plan.total, plan.casts) == (converted, total, casts)
    assert not plan.is_training and plan.anatomy is None and plan.cost is None
    assert plan.ir == cli("compile", path, "--precision", precision, "--seq", "8", *flags,
                          "--emit", "ir").stdout
    assert plan.dot == cli("compile", path, "--precision", precision, "--seq", "8", *flags,
                           "--emit", "dot").stdout


def test_compile_a_training_step_has_anatomy_and_cost():
    path = FIXTURES / "gpt2_lm"
    plan = castor.compile(path, "bf16", train=True, batch=2, seq=8, remat="selective",
                          optimizer="adamw", gpu="a100")
    assert plan.is_training
    out = cli("compile", path, "--precision", "bf16", "--train", "--batch", "2", "--seq", "8",
              "--remat", "selective", "--optimizer", "adamw", "--gpu", "a100").stdout
    assert plan.summary == out
    a = plan.anatomy
    # Saved activations live in the arena; every other role is its own memory.
    assert a["total"] == sum(v for k, v in a.items() if k not in ("total", "saved_activations"))
    assert 0 < a["saved_activations"] <= a["arena"]
    # The anatomy's total is the planned peak the report prints.
    assert f"{a['total']:,}" in out
    assert a["master_weights"] > 0 and a["optimizer_state"] == 2 * a["master_weights"]
    c = plan.cost
    assert c["gpu"].startswith("A100")
    assert c["flops_per_token"] > 0 and c["step_seconds"] > 0 and 0 < c["mfu"] < 1
    assert plan.json == cli("compile", path, "--precision", "bf16", "--batch", "2", "--seq",
                            "8", "--remat", "selective", "--gpu", "a100",
                            "--emit", "plan").stdout


def test_compile_reads_an_ir_file():
    ir = next((ROOT / "tests" / "ir").glob("*.ir"))
    plan = castor.compile(ir, "bf16")
    assert plan.summary == cli("compile", ir, "--precision", "bf16").stdout


def test_explain_matches_the_cli():
    path = FIXTURES / "gpt2_lm"
    plan = castor.compile(path, "bf16", seq=8)
    decisions = plan.explain("*attn*")
    assert decisions, "the glob matches attention nodes"
    out = cli("compile", path, "--precision", "bf16", "--seq", "8", "--explain", "*attn*").stdout
    blocks = out.split("\n\n%")[1:]
    assert len(blocks) == len(decisions)
    for d, block in zip(decisions, blocks):
        assert str(d) == "%" + block.rstrip("\n")
        assert str(d).startswith(f"%{d.node} = {d.op} [{d.op_class}]")
        assert f"writes {', '.join(d.writes)}" in str(d)
        assert f"why: {d.why}" in str(d)
        assert all(f"%{name}: {dtype}" in str(d) for name, dtype in d.reads)
    matmuls = [d for d in decisions if d.op_class == "contraction"]
    assert matmuls and all(d.accumulates == "f32" for d in matmuls)
    assert plan.explain("no such node*") == []


@pytest.mark.parametrize("train", [False, True])
def test_a_plan_round_trips_through_save_and_load(tmp_path, train):
    plan = castor.compile(FIXTURES / "llama_gqa", "bf16", train=train, seq=8)
    plan.save(tmp_path / "plan.json")
    loaded = castor.Plan.load(tmp_path / "plan.json")
    for attr in ["summary", "converted", "total", "casts", "is_training", "ir", "dot", "json",
                 "anatomy", "cost"]:
        assert getattr(loaded, attr) == getattr(plan, attr), attr
    assert [str(d) for d in loaded.explain("*")] == [str(d) for d in plan.explain("*")]


def test_a_saved_training_plan_runs_on_the_cli(tmp_path):
    plan = castor.compile(TINY_GPT2, "bf16", train=True, batch=2, seq=16)
    (tmp_path / "plan.json").write_text(plan.json)
    out = cli("train", TINY_GPT2, "--data", CORPUS, "--plan", tmp_path / "plan.json",
              "--steps", "2", "--device", "cpu").stdout
    assert "done        2 steps" in out


# ---- eval -------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_eval_matches_transformers(variant):
    path = FIXTURES / variant
    batch = load_file(str(path / "input.safetensors"))
    want = load_file(str(path / "expected.safetensors"))
    got = castor.eval(path, batch["input_ids"], attention_mask=batch.get("attention_mask"),
                      token_type_ids=batch.get("token_type_ids"))
    keys = [k for k in want if not k.startswith("autocast_")]
    assert keys
    for key in keys:
        assert got[key].dtype == np.float32 and got[key].shape == want[key].shape, key
        # The CLI's tolerance (tests/eval_vs_pytorch.rs).
        assert rel_err(got[key], want[key]) < 1e-4, key


def test_eval_is_the_cli_eval_bit_for_bit(tmp_path):
    path = FIXTURES / "gpt2_lm"
    cli("eval", path, "--input", path / "input.safetensors", "--out", tmp_path / "o.safetensors",
        "--precision", "bf16", "--grad", "--device", "cpu")
    want = load_file(str(tmp_path / "o.safetensors"))
    batch = load_file(str(path / "input.safetensors"))
    got = castor.eval(path, batch["input_ids"], attention_mask=batch.get("attention_mask"),
                      precision="bf16", grad=True)
    assert sorted(got) == sorted(want)
    assert "loss" in got and any(k.startswith("grad.") for k in got)
    for key in want:
        assert np.array_equal(got[key], want[key]), key


class ArrayLike:
    """Anything with __array__ (a torch CPU tensor, say)."""

    def __init__(self, a):
        self.a = a

    def __array__(self, dtype=None, copy=None):
        return self.a if dtype is None else self.a.astype(dtype)


def test_eval_takes_anything_with_array_and_int32():
    path = FIXTURES / "llama_gqa"
    ids = load_file(str(path / "input.safetensors"))["input_ids"]
    a = castor.eval(path, ids)
    b = castor.eval(path, ArrayLike(ids.astype(np.int32)))
    assert np.array_equal(a["logits"], b["logits"])


def test_eval_refuses_bad_inputs():
    path = FIXTURES / "gpt2_lm"
    with pytest.raises(castor.InputError, match="outside the vocabulary"):
        castor.eval(path, np.array([[1, 2, 10**6]]))
    with pytest.raises(castor.InputError, match="must be I64 or I32"):
        castor.eval(path, np.zeros((1, 4), np.float32))
    with pytest.raises(castor.InputError, match="expected \\[1, 4\\]"):
        castor.eval(path, np.zeros((1, 4), np.int64), attention_mask=np.ones((1, 3), np.int64))


# ---- train ------------------------------------------------------------------------------------


def test_train_calls_back_with_every_logged_step(tmp_path):
    records = []
    result = castor.train(TINY_GPT2, CORPUS, steps=4, precision="bf16", batch=2, seq=16,
                          device="cpu", log=tmp_path / "run.jsonl", save=tmp_path / "out",
                          callback=records.append)
    logged = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # The same fields as the JSON log, with the same values (the time fields aside).
    for r, line in zip(records, logged):
        assert r.keys() == line.keys()
        assert {k: v for k, v in r.items() if k != "tokens_per_s"} == \
            {k: v for k, v in line.items() if k != "tokens_per_s"}
    assert result.steps_done == 4 and result.step == 4 and not result.interrupted
    assert result.losses == [(r["step"], pytest.approx(r["loss"])) for r in records]
    assert result.final_loss == pytest.approx(records[-1]["loss"])
    assert result.saved == str(tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").is_file()
    # The checkpoint is a model folder the API reads back.
    assert castor.inspect(tmp_path / "out").family == "gpt2"


def test_train_without_callback_matches_the_cli(tmp_path):
    result = castor.train(TINY_GPT2, CORPUS, steps=3, batch=2, seq=16, device="cpu",
                          log=tmp_path / "py.jsonl")
    cli("train", TINY_GPT2, "--data", CORPUS, "--steps", "3", "--batch", "2", "--seq", "16",
        "--device", "cpu", "--log", tmp_path / "cli.jsonl")
    py = [json.loads(line)["loss"] for line in (tmp_path / "py.jsonl").read_text().splitlines()]
    ref = [json.loads(line)["loss"] for line in (tmp_path / "cli.jsonl").read_text().splitlines()]
    assert py == ref  # the default precision is the CLI's, and the runs are deterministic
    assert [loss for _, loss in result.losses] == pytest.approx(py)


def test_keyboard_interrupt_saves_and_stops(tmp_path):
    def interrupt(record):
        if record["step"] == 2:
            # What Ctrl-C does: Python's handler flags a KeyboardInterrupt.
            os.kill(os.getpid(), signal.SIGINT)

    # Python's own handler, as in a terminal: a process started in the background by a
    # non-interactive shell inherits SIGINT ignored, and Python then installs none.
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            castor.train(TINY_GPT2, CORPUS, steps=50, batch=2, seq=16, device="cpu",
                         save=tmp_path / "out", callback=interrupt)
    finally:
        signal.signal(signal.SIGINT, saved)
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    # The step running when the interrupt came finishes and is saved; no later one runs.
    assert 2 <= state["step"] <= 3


def test_a_callback_error_stops_the_run_and_is_raised(tmp_path):
    def fail(record):
        raise ValueError(f"stop at {record['step']}")

    with pytest.raises(ValueError, match="stop at 1"):
        castor.train(TINY_GPT2, CORPUS, steps=50, batch=2, seq=16, device="cpu",
                     save=tmp_path / "out", callback=fail)
    assert (tmp_path / "out" / "trainer_state.json").is_file()


def test_training_releases_the_gil():
    ticks = []
    running = threading.Event()

    def tick():
        while not running.is_set():
            time.sleep(0.001)
        while running.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    t = threading.Thread(target=tick)
    t.start()
    running.set()
    start = time.perf_counter()
    castor.train(TINY_GPT2, CORPUS, steps=20, batch=4, seq=64, device="cpu")
    elapsed = time.perf_counter() - start
    running.clear()
    t.join()
    # With the GIL held the thread could not run at all while castor trains.
    assert elapsed > 0.05
    assert len([x for x in ticks if start < x < start + elapsed]) > 10


# ---- errors -----------------------------------------------------------------------------------


def test_unknown_keywords_are_usage_errors():
    with pytest.raises(castor.UsageError, match="--no-such-flag") as e:
        castor.compile(FIXTURES / "gpt2_lm", "bf16", no_such_flag=1)
    assert isinstance(e.value, TypeError) and e.value.exit_code == 2
    with pytest.raises(castor.UsageError, match="invalid value"):
        castor.compile(FIXTURES / "gpt2_lm", "bf17")


def test_errors_carry_the_cli_message_and_exit_code(tmp_path):
    with pytest.raises(castor.CheckpointError) as e:
        castor.inspect(tmp_path / "missing")
    done = __import__("subprocess").run(
        [str(ROOT / "target" / "debug" / "castor"), "inspect", str(tmp_path / "missing")],
        capture_output=True, text=True)
    assert done.returncode == e.value.exit_code == 3
    assert done.stderr.strip() == f"error: {e.value}"
    with pytest.raises(castor.InputError, match="matches no node"):
        castor.compile(FIXTURES / "gpt2_lm", "bf16", keep_f32="no_such_node*")
    with pytest.raises(castor.PolicyError, match="conflicting precision rules"):
        castor.compile(ROOT / "tests" / "ir" / "mlp.ir", "bf16",
                       policy=ROOT / "tests" / "malformed" / "policy" / "conflicting_rules.toml")
    with pytest.raises(castor.OutputError):
        castor.compile(FIXTURES / "gpt2_lm", "bf16", train=True, report=tmp_path / "no" / "r.html")


# ---- the malformed-input corpus ---------------------------------------------------------------


def malformed_cases():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        import tomli as tomllib
    text = (ROOT / "tests" / "malformed" / "cases.toml").read_text()
    return tomllib.loads(text)["case"]


# The corpus's flags that take no value.
SWITCHES = {"strict", "train", "grad", "ir", "verify", "pack"}


def call(args, out):
    """A corpus case's command line as a call of the Python API."""
    cases = str(ROOT / "tests" / "malformed")
    args = [a.replace("{cases}", cases).replace("{root}", str(ROOT)).replace("{out}", str(out))
            for a in args]
    command, rest = args[0], args[1:]
    kwargs, positional = {}, []
    i = 0
    while i < len(rest):
        if not rest[i].startswith("--"):
            positional.append(rest[i])
            i += 1
            continue
        key = rest[i][2:].replace("-", "_")
        if key in SWITCHES:
            value, i = True, i + 1
        else:
            value, i = rest[i + 1], i + 2
        if key in kwargs:
            kwargs[key] = [*([kwargs[key]] if not isinstance(kwargs[key], list) else kwargs[key]),
                           value]
        else:
            kwargs[key] = value
    (path,) = positional
    if command == "inspect":
        return castor.inspect(path, **kwargs)
    if command == "compile":
        precision = kwargs.pop("precision", "fp32")
        return castor.compile(path, precision, **kwargs)
    if command == "eval":
        batch = load_file(kwargs.pop("input"))
        kwargs.pop("out", None)
        return castor.eval(path, batch.pop("input_ids"), **batch, **kwargs)
    if command == "train":
        return castor.train(path, kwargs.pop("data"), **kwargs)
    raise AssertionError(f"no Python call for `{command}`")


@pytest.mark.parametrize("case", malformed_cases(), ids=lambda c: c["name"])
def test_every_malformed_case_raises_a_castor_error(case, tmp_path, caplog):
    if case["exit"] == 0:
        call(case["args"], tmp_path)
        return
    with pytest.raises(castor.CastorError) as e:
        call(case["args"], tmp_path)
    # A subclass that says what failed, the CLI's exit code, and what the CLI says.
    assert type(e.value) is not castor.CastorError, str(e.value)
    assert e.value.exit_code == case["exit"]
    # The CLI's stderr is the error (the exception) and its warnings (the `castor` logger).
    for fragment in case.get("stderr", []):
        if fragment.startswith("warning: "):
            assert fragment.removeprefix("warning: ") in caplog.text
        else:
            text = fragment.removeprefix("error: ")
            assert text in str(e.value) or text in caplog.text


def test_loading_what_is_not_a_plan_is_refused(tmp_path):
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(castor.InputError, match="not a saved castor plan"):
        castor.Plan.load(tmp_path / "x.json")
    plan = castor.compile(FIXTURES / "gpt2_lm", "bf16", seq=8)
    plan.save(tmp_path / "p.json")
    saved = json.loads((tmp_path / "p.json").read_text())
    saved["graph"] = saved["graph"].replace("matmul(", "matmul((", 1)
    (tmp_path / "p.json").write_text(json.dumps(saved))
    with pytest.raises(castor.IRError, match="p.json"):
        castor.Plan.load(tmp_path / "p.json")
    with pytest.raises(castor.InputError, match="cannot read"):
        castor.Plan.load(tmp_path / "missing.json")


def test_importing_loads_no_cuda_library():
    import subprocess
    import sys

    code = "import castor; print(open('/proc/self/maps').read())"
    maps = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout
    for lib in ["libcuda", "libcudart", "libnvrtc", "libcublas"]:
        assert lib not in maps, lib


def test_asking_for_a_missing_gpu_is_a_device_error():
    if os.environ.get("CASTOR_REQUIRE_GPU") == "1":
        pytest.skip("a GPU is present")
    batch = load_file(str(FIXTURES / "gpt2_lm" / "input.safetensors"))
    with pytest.raises(castor.DeviceError) as e:
        castor.eval(FIXTURES / "gpt2_lm", batch["input_ids"], device="cuda")
    assert e.value.exit_code == 5


def test_a_data_parallel_plan_is_one_ranks():
    one = castor.compile(ROOT / "assets" / "configs" / "llama-2-7b.json", "bf16", train=True,
                         seq=4096, remat="full")
    ranks = castor.compile(ROOT / "assets" / "configs" / "llama-2-7b.json", "bf16", train=True,
                           seq=4096, remat="full", world_size=8, zero=2)
    assert ranks.cost["world_size"] == 8 and one.cost["world_size"] == 1
    assert ranks.cost["communication_seconds"] > 0 == one.cost["communication_seconds"]
    assert ranks.anatomy["gradients"] * 7 < one.anatomy["gradients"]
    assert "reduce_scatter" in ranks.ir and "all_gather" in ranks.ir


def test_zero3_shards_every_parameter_and_trains_on_cpu_ranks(tmp_path):
    plan = castor.compile(ROOT / "assets" / "configs" / "llama-2-7b.json", "bf16", train=True,
                          seq=4096, remat="full", world_size=8, zero=3)
    two = castor.compile(ROOT / "assets" / "configs" / "llama-2-7b.json", "bf16", train=True,
                         seq=4096, remat="full", world_size=8, zero=2)
    assert plan.anatomy["low_precision_weights"] * 7 < two.anatomy["low_precision_weights"]
    assert ".gathered" in plan.ir and ".regathered" in plan.ir
    result = castor.train(ROOT / "assets" / "tiny-gpt2.json", ROOT / "assets" / "corpus.txt",
                          steps=2, batch=2, seq=16, world_size=2, zero=3, device="cpu")
    assert result.steps_done == 2 and result.final_loss > 0


# ---- a library, not a wrapped CLI (issue: the user's path, round two) -------------------------


def test_defaults_are_the_clis(tmp_path):
    # One default precision everywhere: the CLI's fp32.
    path = FIXTURES / "gpt2_lm"
    assert castor.compile(path, seq=8).summary == cli("compile", path, "--seq", "8").stdout
    castor.train(TINY_GPT2, CORPUS, steps=2, batch=2, seq=16, device="cpu",
                 log=tmp_path / "py.jsonl")
    cli("train", TINY_GPT2, "--data", CORPUS, "--steps", "2", "--batch", "2", "--seq", "16",
        "--device", "cpu", "--log", tmp_path / "cli.jsonl")
    py = [json.loads(line)["loss"] for line in (tmp_path / "py.jsonl").read_text().splitlines()]
    ref = [json.loads(line)["loss"] for line in (tmp_path / "cli.jsonl").read_text().splitlines()]
    assert py == ref


def test_calls_are_quiet_and_log_instead(tmp_path, capfd, caplog):
    caplog.set_level("INFO", logger="castor")
    castor.compile(FIXTURES / "gpt2_lm", "bf16", seq=8)
    castor.train(TINY_GPT2, CORPUS, steps=2, batch=2, seq=16, device="cpu")
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    messages = [r.getMessage() for r in caplog.records if r.name == "castor"]
    assert any(m.startswith("step      2  loss") for m in messages), messages
    assert any(m.startswith("done        2 steps") for m in messages), messages
    # verbose=True prints what the CLI prints.
    castor.train(TINY_GPT2, CORPUS, steps=2, batch=2, seq=16, device="cpu", verbose=True)
    out, _ = capfd.readouterr()
    assert "step      2  loss" in out


def test_warnings_reach_the_logger_at_warning(tmp_path, caplog):
    gpt2 = tmp_path / "gpt2"
    import shutil
    shutil.copytree(FIXTURES / "gpt2_lm", gpt2)
    config = json.loads((gpt2 / "config.json").read_text())
    (tmp_path / "bare.json").write_text(json.dumps({k: v for k, v in config.items()
                                                    if k != "n_layer"}))
    castor.inspect(tmp_path / "bare.json")
    warned = [r for r in caplog.records if r.name == "castor" and r.levelname == "WARNING"]
    assert any("config.json has no `n_layer`" in r.getMessage() for r in warned), caplog.text


def test_a_raising_callback_stops_at_its_step_and_saves_it(tmp_path):
    seen = []

    def callback(record):
        seen.append(record["step"])
        if record["step"] == 3:
            raise ValueError("enough")

    with pytest.raises(ValueError, match="enough"):
        castor.train(TINY_GPT2, CORPUS, steps=50, batch=2, seq=16, device="cpu",
                     save=tmp_path / "out", callback=callback)
    assert seen == [1, 2, 3]
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    assert state["step"] == 3


def test_training_data_in_memory(tmp_path):
    texts = CORPUS.read_text().split("\n\n")
    # Texts are documents, as a .jsonl file of texts is.
    (tmp_path / "docs.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in texts))
    from_list = castor.train(TINY_GPT2, texts, steps=2, batch=2, seq=16, device="cpu")
    from_file = castor.train(TINY_GPT2, tmp_path / "docs.jsonl", steps=2, batch=2, seq=16,
                             device="cpu")
    assert from_list.losses == from_file.losses
    # Token arrays are one stream, as a token file is.
    ids = np.random.default_rng(0).integers(0, 256, 4096)
    ids.astype(np.uint16).tofile(tmp_path / "tokens.bin")
    from_arrays = castor.train(TINY_GPT2, [ids[:1000], ids[1000:]], steps=2, batch=2, seq=16,
                               device="cpu")
    from_bin = castor.train(TINY_GPT2, tmp_path / "tokens.bin", steps=2, batch=2, seq=16,
                            device="cpu")
    assert from_arrays.losses == from_bin.losses
    with pytest.raises(castor.InputError, match="integer token ids"):
        castor.train(TINY_GPT2, [np.zeros(4, np.float32)], steps=1, device="cpu")


def test_generate_merge_and_load(tmp_path):
    cli("demo", "--steps", "10", "--out", tmp_path / "demo")
    ckpt = tmp_path / "demo" / "checkpoint"
    g = castor.generate(ckpt, "The compiler ", max_new_tokens=8)
    done = cli("generate", ckpt, "--prompt", "The compiler ", "--max-new-tokens", "8")
    assert g.text == done.stdout.rstrip("\n")
    assert len(g.tokens) == 8 and g.stopped == "--max-new-tokens reached"
    with pytest.raises(castor.InputError, match="has no chat template"):
        castor.generate(ckpt, "The compiler", chat=True)
    (ckpt / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}"}))
    reply = castor.generate(ckpt, "The compiler", chat=True, system="Be terse.",
                            max_new_tokens=8)
    done = cli("generate", ckpt, "--chat", "--prompt", "The compiler", "--system", "Be terse.",
               "--max-new-tokens", "8")
    assert reply.text == done.stdout.rstrip("\n") and len(reply.tokens) == 8
    weights = castor.load(ckpt)
    ref = load_file(ckpt / "model.safetensors")
    assert weights.keys() == ref.keys()
    for name, value in ref.items():
        np.testing.assert_array_equal(weights[name], value.astype(np.float32))
    moments = castor.load(ckpt / "optimizer.safetensors")
    assert moments and all(v.dtype == np.float32 for v in moments.values())
    gpt2 = FIXTURES / "gpt2_lm"
    merged = castor.merge(gpt2, gpt2 / "lora", tmp_path / "merged")
    cli("merge", gpt2, "--adapter", gpt2 / "lora", "--out", tmp_path / "merged-cli")
    ours, theirs = castor.load(merged), castor.load(tmp_path / "merged-cli")
    assert ours.keys() == theirs.keys()
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name])
