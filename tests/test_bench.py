"""The benchmark command's structure (never its timings: this machine is shared and noisy)."""

import importlib.util
import itertools
import json
import pathlib
import subprocess
import sys
import types

import pytest
import torch
from testing import cuda_only

import torchclip
from torchclip.bench import __main__ as bench
from torchclip.bench import adaptive, training, workloads
from torchclip.bench import timing as bench_timing
from torchclip.bench.timing import byte_stream_buffer

# (the --training models and the -backward workloads build theirs with transformers)
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def python_cli(*arguments, timeout=300, cwd=None) -> subprocess.CompletedProcess:
    """This interpreter run with `arguments` in a fresh process, its output captured."""
    return subprocess.run([sys.executable, *arguments], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def bench_cli(*argv, timeout=300) -> subprocess.CompletedProcess:
    """`torchclip-bench argv...` in a fresh process, its output captured."""
    return python_cli("-m", "torchclip.bench", *argv, timeout=timeout)


@pytest.fixture
def many_small(tmp_path) -> str:
    """A workload of 500 tensors of 100 values (named "500x100" in the rows, after the file): the many-small-tensors
    rows' code at a twentieth of 10000x100's cost, most of which is torch's per-tensor Python loops."""
    path = tmp_path / "500x100.json"
    path.write_text(json.dumps({"shapes": [[100]] * 500}))
    return str(path)


JSON_FIELDS = {
    "op",
    "workload",
    "dtype",
    "threads",
    "torch_ms",
    "torch_no_foreach_ms",
    "torchclip_ms",
    "bound_ms",
    "speedup",
    "bound_ratio",
    "spread",
}


def test_quick_run_prints_a_table_and_writes_json(tmp_path, many_small):
    out = tmp_path / "rows.json"
    result = bench_cli(
        "--quick",
        "--workload",
        "mobilenet_v3_small",
        "--workload",
        many_small,
        "--rounds",
        "3",
        "--json",
        str(out),
        "--plot",
        str(tmp_path / "plot.png"),
        "--markdown",
        str(tmp_path / "RESULTS.md"),
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].split()[:4] == ["workload", "dtype", "thr", "op"]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * len(bench.OPS)
    for row in rows:
        assert JSON_FIELDS <= set(row)
        assert row["torch_ms"] > 0 and row["torchclip_ms"] > 0 and row["bound_ms"] > 0
    assert {r["workload"] for r in rows} == {"mobilenet_v3_small", "500x100"}
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "RESULTS.md").read_text()
    assert "![speed-up and fraction of the bound](plot.png)" in page and "clip_grad_norm_ (no clip)" in page


@pytest.mark.parametrize("separate", [False, True])
def test_gradients_are_views_of_the_flat_buffer_or_their_own_allocations(separate):
    g = bench.Grads([[3, 4], [5], [2, 2]], torch.float32, separate=separate)
    shared = [p.grad.untyped_storage().data_ptr() == g.flat.untyped_storage().data_ptr() for p in g.params]
    assert shared == [not separate] * 3
    assert torch.equal(torch.cat([p.grad.flatten() for p in g.params]), g.flat)
    for p in g.params:
        p.grad.zero_()
    g.reset()  # both layouts hold the flat buffer's (new) values again
    assert torch.equal(torch.cat([p.grad.flatten() for p in g.params]), g.flat) and g.flat.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_bound_of_a_16_bit_row_streams_its_bytes_in_float32(dtype):
    g = bench.Grads([[3, 4], [6], [2, 2]], dtype)
    buffer = byte_stream_buffer(g.flat)
    assert buffer.dtype == torch.float32 and buffer.is_contiguous()
    assert buffer.numel() * buffer.element_size() == g.flat.numel() * g.flat.element_size()
    assert buffer.untyped_storage().data_ptr() != g.flat.untyped_storage().data_ptr()
    assert g.bound_buffer is g.bound_buffer and g.bound_buffer.dtype == torch.float32  # made once per workload
    for op in bench.OPS:
        bench.candidates_for(op, g).bound()
    weights = torch.randn(g.flat.numel(), dtype=dtype)
    adaptive.candidates("ClipGradByUnitwiseNorm", g, weights)[0][2]()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_bound_of_a_32_or_64_bit_row_is_the_gradients_own_buffer(dtype):
    g = bench.Grads([[3, 4], [6], [2, 2]], dtype)
    assert byte_stream_buffer(g.flat) is g.flat and g.bound_buffer is g.flat


def test_separate_gradients_run_and_are_named_in_the_header(tmp_path, many_small):
    out = tmp_path / "rows.json"
    result = bench_cli("--quick", "--workload", many_small, "--rounds", "2", "--grads", "separate", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "gradients: separate allocations" in result.stdout.splitlines()[0]
    assert json.loads(out.read_text())["grads"] == "separate"


def test_exact_rows_time_the_exact_norms_beside_todays(tmp_path, many_small):
    out = tmp_path / "rows.json"
    argv = ["--quick", "--workload", many_small, "--rounds", "2", "--exact", "--json", str(out)]
    result = bench_cli(*argv)
    assert result.returncode == 0, result.stderr
    assert "exact ms" in result.stdout and "exact x" in result.stdout
    for row in json.loads(out.read_text())["rows"]:
        assert (row["exact_ms"] is not None) == (row["op"] in bench.NORM_OPS), row["op"]
        if row["exact_ms"] is not None:
            median, low, high = row["exact_ratio"]
            assert 0 < low <= median <= high
    calls = []
    exact_call = bench.with_exact_norms(lambda: calls.append(torchclip.get_exact_norm()))
    exact_call()
    assert calls == [True] and torchclip.get_exact_norm() is False


def test_busy_rows_on_two_threads_time_the_call_on_one_thread_beside_them(tmp_path, many_small):
    out = tmp_path / "rows.json"
    argv = [
        "--quick",
        "--workload",
        many_small,
        "--rounds",
        "2",
        "--busy",
        "--threads",
        "1,2",
        "--op",
        "get_total_norm",
    ]
    result = bench_cli(*argv, "--exact", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "1 thr ms" in result.stdout and "x 1 thr" in result.stdout
    rows = json.loads(out.read_text())["rows"]
    assert sorted(row["threads"] for row in rows) == [1, 2]
    for row in rows:
        assert (row["one_thread_ms"] is not None) == (row["threads"] == 2), row
        assert row["exact_ms"] is not None  # (the exact call and the one-thread call in the same rounds)
        if row["one_thread_ms"] is not None:
            median, low, high = row["one_thread_ratio"]
            assert 0 < low <= median <= high
    threads = []
    one_thread_call = bench.on_one_thread(lambda: threads.append(torch.get_num_threads()))
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        one_thread_call()
        assert threads == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)


def test_generator_parameters_run_and_are_named_in_the_header(tmp_path):
    out = tmp_path / "rows.json"
    result = bench_cli(
        "--quick", "--workload", "mobilenet_v3_small", "--rounds", "2", "--params", "generator", "--json", str(out)
    )
    assert result.returncode == 0, result.stderr
    assert "parameters passed as a generator" in result.stdout.splitlines()[0]
    assert json.loads(out.read_text())["params"] == "generator"


@pytest.mark.parametrize("op", bench.OPS)
def test_generator_candidates_clip_what_list_candidates_clip(op):
    # Each candidate, handed generators, does to the gradients (and returns) what it does handed the list.
    results = []
    for as_generators in (False, True):
        g = bench.Grads([[30, 4], [50], [7, 7]], torch.float32)
        c = bench.candidates_for(op, g, as_generators)
        outputs = []
        for fn in (c.torch, c.torch_no_foreach, c.torchclip):
            g.reset()
            if c.prepare is not None:
                c.prepare()
            returned = fn()
            outputs.append((g.flat.clone(), returned if isinstance(returned, torch.Tensor) else None))
        results.append(outputs)
    for (listed, listed_norm), (generated, generated_norm) in zip(*results):
        torch.testing.assert_close(generated, listed, rtol=0, atol=0)
        torch.testing.assert_close(generated_norm, listed_norm, rtol=0, atol=0)
        assert listed_norm is None or listed_norm > 0  # (a spent generator would give a norm of 0)


def test_plot_without_matplotlib_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(SystemExit):
        bench.parse_args(["--plot", "out.png"])
    assert "--plot needs matplotlib: pip install torchclip[bench]" in capsys.readouterr().err


def test_model_workload_is_built_on_the_meta_device():
    label, shapes = workloads.resolve("model:torch.nn:Transformer")
    assert label == "Transformer" and len(shapes) > 100


def test_every_shipped_workload_loads():
    for name in workloads.names():
        if name in workloads.BACKWARD and not HAS_TRANSFORMERS:
            continue
        shapes = workloads.shapes(name)
        assert shapes and all(isinstance(s, list) for s in shapes)
    assert workloads.numel(workloads.shapes("gpt2_124m")) == 124439808
    if HAS_TRANSFORMERS:  # the same model as the shipped shapes, its parameters in another order
        assert sorted(map(tuple, workloads.shapes("resnet50-backward"))) == sorted(
            map(tuple, workloads.shapes("resnet50"))
        )


def tiny_model():
    """A --training-style model (called on its batch, it returns an object with .loss), small enough for any test."""

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))

        def forward(self, x):
            return types.SimpleNamespace(loss=self.net(x).square().sum())

    return WithLoss(), {"x": torch.randn(5, 4, generator=torch.Generator().manual_seed(1))}


@pytest.mark.parametrize("separate", [False, True])
def test_a_backward_workloads_values_are_its_models_gradients(monkeypatch, separate):
    monkeypatch.setitem(workloads.BACKWARD, "tiny-backward", "tiny")
    monkeypatch.setitem(training.MODELS, "tiny", tiny_model)
    workloads.backward_gradients.cache_clear()
    try:
        torch.manual_seed(0)  # (the model's weights: what the workload seeds too)
        model, batch = tiny_model()
        model(**batch).loss.backward()
        expected = [p.grad for p in model.parameters()]
        label, shapes = workloads.resolve("tiny-backward")
        assert label == "tiny-backward" and shapes == [list(e.shape) for e in expected]
        assert all(torch.equal(v, e) for v, e in zip(workloads.values("tiny-backward"), expected))
        assert workloads.values("resnet50") is None  # (Gaussian)
        g = bench.Grads(shapes, torch.bfloat16, separate=separate, values=workloads.values("tiny-backward"))
        rounded = [e.to(torch.bfloat16) for e in expected]
        assert all(torch.equal(p.grad, r) for p, r in zip(g.params, rounded))
        for p in g.params:
            p.grad.zero_()
        g.flat.zero_()
        g.reset()  # the model's gradients again, not Gaussian values
        assert all(torch.equal(p.grad, r) for p, r in zip(g.params, rounded))
    finally:
        workloads.backward_gradients.cache_clear()


def test_a_backward_workload_without_its_models_package_is_named(monkeypatch):
    def needs_a_package():
        raise ModuleNotFoundError("No module named 'transformers'")

    monkeypatch.setitem(workloads.BACKWARD, "missing-backward", "missing")
    monkeypatch.setitem(training.MODELS, "missing", needs_a_package)
    workloads.backward_gradients.cache_clear()
    try:
        with pytest.raises(ValueError, match="--workload 'missing-backward' needs transformers"):
            workloads.resolve("missing-backward")
    finally:
        workloads.backward_gradients.cache_clear()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workload", "nope"], "unknown; choose from"),
        (["--dtype", "int8"], "--dtype 'int8': unknown"),
        (["--threads", "0"], "expected a comma list of positive integers"),
        (["--grads", "flat"], "invalid choice: 'flat'"),
        (["--model", "torch.nn"], "expected module:callable"),
        (["--model", "no_such_module:f"], "cannot import it"),
        (["--op", "clip"], "--op 'clip': unknown; choose from"),
        (["--per-sample", "--workload", "gpt2_124m"], "--per-sample --workload 'gpt2_124m': unknown"),
        (["--per-sample", "--batch", "0"], "--batch '0': expected a comma list of positive integers"),
        pytest.param(
            ["--device", "cuda"],
            "--device cuda: torch sees no CUDA device here",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here"),
        ),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


@cuda_only
def test_quick_cuda_run(tmp_path):
    out = tmp_path / "rows.json"
    result = bench_cli("--quick", "--device", "cuda", "--workload", "10000x100", "--rounds", "3", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "GPU: " in result.stdout.splitlines()[0]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(bench.OPS) and all(r["device"] == "cuda" and r["torchclip_ms"] > 0 for r in rows)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_balanced_orders_give_every_candidate_every_predecessor_equally(n):
    orders = bench.balanced_orders(n)
    follows = {}
    for order in orders:
        assert sorted(order) == list(range(n))
        for before, after in itertools.pairwise(order):
            follows[before, after] = follows.get((before, after), 0) + 1
    assert set(follows) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert len(set(follows.values())) == 1, follows


@pytest.mark.parametrize("n, twins", [(5, [(4, 2)]), (5, [(2, 4)]), (6, [(4, 2), (2, 5)]), (2, [(0, 1)])])
def test_twin_rounds_pair_calls_that_follow_the_same_calls(monkeypatch, n, twins):
    # Each timed call's "time" is its place in the run, so a pair names the two calls it compares.
    calls = []
    monkeypatch.setattr(bench_timing, "timed", lambda fn, prepare=None, sync=None: (fn(), len(calls) - 1)[1])
    paired = []
    bench_timing.interleave([lambda k=k: calls.append(k) for k in range(n)], 7, 0, twins=twins, twins_out=paired)
    design = len(bench.balanced_orders(n)) * (1 + len(twins))
    whole = -(-7 // design) * design
    assert len(calls) == n * whole  # 7 rounds run as whole designs
    for (a, b), (firsts, seconds) in zip(twins, paired):
        rows = whole // (1 + len(twins))  # (each candidate opens rows / n of them: its calls there are not paired)
        assert len(firsts) == len(seconds) == 2 * rows - 2 * (rows // n)
        swap = {a: b, b: a}
        for first, second in zip(firsts, seconds):
            assert {calls[first], calls[second]} == {a, b} and first % n == second % n
            before_first = calls[first - first % n : first]
            before_second = [swap.get(c, c) for c in calls[second - second % n : second]]
            assert first % n != 0 and before_first == before_second
    calls.clear()
    bench_timing.interleave([lambda k=k: calls.append(k) for k in range(n)], 7, 0)
    assert len(calls) == n * 7  # (no twins: the rounds as asked)


def test_step_mode_rows(tmp_path):
    """--step: the four candidates on one optimizer, and the added-cost columns derived from them."""
    out = tmp_path / "steps.json"
    page = tmp_path / "RESULTS-step.md"
    result = bench_cli(
        "--step",
        "adamw-fused",
        "--step",
        "sgd",
        "--workload",
        "2000x64x64",
        "--rounds",
        "3",
        "--quick",
        "--json",
        str(out),
        "--markdown",
        str(page),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1].split()[:4] == ["optimizer", "workload", "dtype", "thr"]
    rows = json.loads(out.read_text())["step_rows"]
    assert [r["optimizer"] for r in rows] == ["adamw-fused", "sgd"]
    for r in rows:
        assert min(r["step_ms"], r["torch_clip_step_ms"], r["torchclip_step_ms"], r["total_norm_ms"]) > 0
        assert r["torchclip_added_reads"] == pytest.approx((r["torchclip_step_ms"] - r["step_ms"]) / r["total_norm_ms"])
    text = page.read_text()
    assert "torchclip-bench --step adamw-fused --step sgd" in text and result.stdout.splitlines()[1] in text


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="--training's models need transformers")
@pytest.mark.parametrize("ranks", [1, 2])
def test_training_mode_rows(tmp_path, ranks):
    """--training: whole steps of each model four ways (2 ranks: DistributedDataParallel over gloo), with the
    step rows on one page."""
    out, page = tmp_path / "training.json", tmp_path / "RESULTS-step.md"
    models = ["gpt2-small", "resnet50"] if ranks == 1 else ["resnet50"]
    arguments = [arg for model in models for arg in ("--training", model)]
    result = bench_cli(
        *arguments,
        "--ranks",
        str(ranks),
        "--rounds",
        "1",
        "--quick",
        "--json",
        str(out),
        "--markdown",
        str(page),
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["training_rows"]
    assert [(r["model"], r["ranks"]) for r in rows] == [(model, ranks) for model in models]
    for r in rows:
        assert set(r["step_ms"]) == set(r["after_backward_ms"]) == {"no clip", "torch clip", "folded", "in backward"}
        assert min(r["step_ms"].values()) > 0 and r["total_norm_ms"] > 0 and r["parameters"] > 2e7
        assert all(0 < after < r["step_ms"][c] for c, after in r["after_backward_ms"].items())
    assert "## The training step" in page.read_text()


def test_adaptive_mode_rows(tmp_path):
    """--adaptive: every adaptive clip, its ratios derived from the timed candidates; the references that
    are installed (zclip, autoclip; timm where it is) timed beside it."""
    out = tmp_path / "adaptive.json"
    result = bench_cli("--adaptive", "--workload", "2000x64x64", "--rounds", "3", "--quick", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1].split()[:4] == ["clip", "workload", "dtype", "thr"]
    rows = json.loads(out.read_text())["adaptive_rows"]
    assert [r["clip"] for r in rows] == ["ClipGradByZScore", "ClipGradByQuantile (global)", "ClipGradByUnitwiseNorm"]
    for r in rows:
        assert min(r["torchclip_ms"], r["global_norm_ms"], r["bound_ms"]) > 0
        assert r["bound_ratio"] == pytest.approx(r["torchclip_ms"] / r["bound_ms"])
        assert r["global_norm_ratio"] == pytest.approx(r["torchclip_ms"] / r["global_norm_ms"])
    installed = {"ClipGradByZScore": "zclip", "ClipGradByQuantile (global)": "autoclip"}
    for r in rows[:2]:
        assert (r["reference_ms"] > 0) == (importlib.util.find_spec(installed[r["clip"]]) is not None)


def test_per_sample_mode_rows(tmp_path):
    """--per-sample: torchclip's two passes with and without noise, and Opacus's DPOptimizer where it is
    installed, in reads of the per-sample gradients."""
    out = tmp_path / "per_sample.json"
    result = bench_cli("--per-sample", "--quick", "--rounds", "2", "--batch", "4", "--json", str(out))
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["per_sample_rows"]
    assert [(r["workload"], r["dtype"], r["batch"]) for r in rows] == [
        ("resnet20", "float32", 4),
        ("resnet20", "bfloat16", 4),
    ]
    opacus_installed = importlib.util.find_spec("opacus") is not None
    for r in rows:
        assert r["read_ms"] > 0 and r["torchclip_reads"] > 0 and r["torchclip_noise_reads"] > 0
        assert (r["opacus_noise_reads"] is not None) == opacus_installed


def test_ratio_interval_brackets_the_median_and_narrows_with_more_pairs():
    from torchclip.bench.intervals import ratio_interval

    noisy = [1.0 + 0.1 * ((7 * i) % 11 - 5) / 5 for i in range(12)]  # ratios spread +-10% around 1
    median, low, high = ratio_interval(noisy, [1.0] * 12)
    assert low <= median <= high and high - low < 0.15
    _, low48, high48 = ratio_interval(noisy * 4, [1.0] * 48)
    assert high48 - low48 < high - low
    assert ratio_interval([2.0, 4.0], [1.0, 2.0]) == (2.0, 2.0, 2.0)  # paired: each ratio is 2


# The scripts in bench/ beside the package, absent where the tests run against an installed wheel (./dev test-torch,
# test-wheel copy tests/ alone).
BENCH_SCRIPTS = pathlib.Path(__file__).resolve().parent.parent / "bench"
needs_bench_scripts = pytest.mark.skipif(
    not (BENCH_SCRIPTS / "compare_builds.py").exists(), reason="bench/'s scripts are not beside these tests"
)


@needs_bench_scripts
def test_compare_builds_exact_prints_an_interval_per_row(many_small):
    root = pathlib.Path(__file__).resolve().parent.parent
    result = python_cli(
        str(root / "bench" / "compare_builds.py"),
        "--exact",
        "--pairs",
        "2",
        "--bar",
        "100",
        "--quick",
        "--workload",
        many_small,
        "--rounds",
        "2",
        cwd=root,
    )
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| 500x100 |")]
    assert rows and all(line.rstrip().endswith("| yes |") for line in rows), result.stdout
    for line in rows:
        low, high = (float(x) for x in line.split("|")[8].split("-"))
        assert 0 < low <= float(line.split("|")[7]) <= high


@needs_bench_scripts
def test_compare_builds_step_gives_each_builds_added_reads_and_the_step_ratio(many_small):
    """--step: the rows of torchclip-bench --step, each build's reads added by the folded clip over the runs and
    the clipped step's candidate / baseline time (one tree as both builds: two fresh processes a pair)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    argv = ["--baseline", str(root), "--pairs", "2", "--bar", "1000", "--step", "sgd-fused", "--workload", many_small]
    result = python_cli(str(root / "bench" / "compare_builds.py"), *argv, "--rounds", "2", cwd=root)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| sgd-fused | 500x100 | float32 |")]
    assert len(rows) == 1 and rows[0].rstrip().endswith("| yes |"), result.stdout
    cells = [cell.strip() for cell in rows[0].split("|")[1:-1]]
    assert len(cells) == 10 and float(cells[6]) > 0, cells  # (candidate / baseline step ms)


@needs_bench_scripts
def test_instruction_count_driver_makes_the_rows_call_and_its_summary_is_read():
    root = pathlib.Path(__file__).resolve().parent.parent
    argv = ["--workload", "10000x100", "--op", "ClipGradByValue", "--calls", "2"]
    result = python_cli(str(root / "bench" / "instructions.py"), *argv)
    assert result.returncode == 0, result.stderr
    sys.path.insert(0, str(root / "bench"))
    try:
        from instructions import collected
    finally:
        sys.path.remove(str(root / "bench"))
    assert collected("==12== Events    : Ir\n==12== Collected : 37058323\n==12==\n") == 37058323
    with pytest.raises(ValueError, match="no callgrind summary"):
        collected("valgrind: command not found")


def test_step_mode_refuses_an_unknown_optimizer():
    with pytest.raises(SystemExit):
        bench.parse_args(["--step", "lamb"])


def test_the_benchmarks_help_prints():
    # (argparse %-formats help strings: a bare "95%" once made --help itself a traceback)
    result = bench_cli("--help")
    assert result.returncode == 0 and "--exact" in result.stdout, result.stderr


@needs_bench_scripts
@pytest.mark.parametrize("script", sorted(path.name for path in BENCH_SCRIPTS.glob("*.py")))
def test_every_bench_scripts_help_prints(script):
    result = python_cli(str(BENCH_SCRIPTS / script), "--help")
    assert result.returncode == 0 and "usage:" in result.stdout, result.stderr
