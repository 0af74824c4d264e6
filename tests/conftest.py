"""Shared fixtures: a tiny real-architecture model, the stdlib corpus, and plans + emitted configs built from them.

No hub access anywhere: models and tokenizers are made locally by toolkit.run.tiny.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import multiprocessing.process
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.quick_launch import quick_launch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# transformers and huggingface_hub bind their log handler to sys.stderr the first time a logger is asked for. Bound
# inside a test that captures stderr (capsys), it keeps that test's stream, closed after it, and the next warning
# prints "--- Logging error ---" into whichever test logs next (a test asserting one line of stderr then fails, in
# some selections and orders only). Bind them here, to the session's own stream.
from huggingface_hub.utils import logging as _hub_logging  # noqa: E402
from transformers.utils import logging as _hf_logging  # noqa: E402

_hf_logging.get_logger("transformers")
_hub_logging.get_logger("huggingface_hub")
# DeepSpeed's CPU ops (CPU Adam, shared-memory collectives) as .ci/setup built them for this venv.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


# The fast loop (`pytest -m "not multiprocess"`) must start no process: a test that starts one (subprocess,
# `accelerate launch`, `toolkit launch`, a fork) without `@pytest.mark.multiprocess` fails, so the mark stays true.
class UnmarkedProcessStart(BaseException):
    """A BaseException, so that no `except Exception` in the code under test can swallow it."""


_running: list = []  # the test item whose setup / call / teardown is running now
_LIBRARY_LOOKUP = os.path.join("ctypes", "util.py")  # find_library runs ldconfig: a lookup, not work a test starts


def _looking_up_a_library() -> bool:
    frame = sys._getframe(2)
    while frame is not None and not frame.f_code.co_filename.endswith(_LIBRARY_LOOKUP):
        frame = frame.f_back
    return frame is not None


def _guard(what: str, original):
    def guarded(*args, **kwargs):
        if _running and _running[-1].get_closest_marker("multiprocess") is None and not _looking_up_a_library():
            raise UnmarkedProcessStart(
                f"{_running[-1].nodeid} starts a process ({what}) but is not marked @pytest.mark.multiprocess")
        return original(*args, **kwargs)
    return guarded


subprocess.Popen._execute_child = _guard("subprocess", subprocess.Popen._execute_child)
multiprocessing.process.BaseProcess.start = _guard("multiprocessing", multiprocessing.process.BaseProcess.start)
for _name in ("system", "fork", "posix_spawn", "posix_spawnp"):
    if hasattr(os, _name):
        setattr(os, _name, _guard(f"os.{_name}", getattr(os, _name)))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks (xdist/remote.py)
def pytest_collection_modifyitems(config, items):
    """`one_core` narrows `multiprocess` (CI runs those tests on the xdist workers beside the unit tests): one without
    the other would put a process-starting test into the fast loop. A test that uses a module-scoped fixture joins
    its module's xdist_group unless it names one, so that a run on two workers (`--dist loadgroup`: both of CI's, and
    the fast loop) makes a module's shared runs and tiny models once, on one worker, where each worker made its own
    (a unit or one_core test was grouped only since 2026-12-04: before, only the multi-process tests of CI's second
    run were)."""
    alone = [item.nodeid for item in items
             if item.get_closest_marker("one_core") and not item.get_closest_marker("multiprocess")]
    if alone:
        raise pytest.UsageError(f"marked one_core but not multiprocess: {', '.join(alone)}")
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        fixtures = getattr(item, "_fixtureinfo", None)
        scopes = {defs[-1].scope for defs in fixtures.name2fixturedefs.values()} if fixtures else set()
        if scopes & {"module", "class", "package"}:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.hookimpl(tryfirst=True)  # before xdist's worker sends the collected ids to the controller (xdist/remote.py)
def pytest_collection_finish(session):
    """Under `--dist loadgroup` the controller groups tests by the `@group` ending of their ids, which xdist's worker
    writes into `item._nodeid`. pytest 9.2 keeps an item's id in `item._id` (a NodeId, _pytest/nodes.py), so that
    write is lost and every group was scattered over both workers: a module fixture's run made once on each, and made
    again each time a worker came back to its module (pytest-xdist issue 1386). The ending is written here where
    xdist's did not take, in xdist's own spelling (the group names, sorted, joined by "_")."""
    from _pytest.nodeid import NodeId

    if not getattr(session.config.option, "loadgroup", False):  # set on xdist's workers only (setup_config)
        return
    for item in session.items:
        names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                        for mark in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix) and isinstance(getattr(item, "_id", None), NodeId):
            item._id = NodeId.parse(item.nodeid + suffix)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running.append(item)
    try:
        yield
    finally:
        _running.pop()


def _freeze_heap() -> None:
    """What the process holds once torch and transformers are imported and a tiny model was made (about 400,000
    objects) goes to the collector's permanent generation, so each full `gc.collect()` a test runs (toolkit.estimate.
    livebytes before every live-bytes reading) walks only what was made since. Collected first: no garbage is kept."""
    gc.collect()
    gc.freeze()


SHARED_MODELS = Path(tempfile.gettempdir()) / f"toolkit-test-models-{os.getuid()}"
"""Where the session fixtures' tiny models live between sessions and beside the other xdist worker."""


def shared_tiny_model(name: str, **options) -> Path:
    """toolkit.run.tiny.make_tiny_model(name, ..., **options) at one path per (options, the code and libraries that
    make it) in SHARED_MODELS, made once and read by every later session and xdist worker. The on-disk cache keys a
    local model's spec and traces by its path as well as its config (toolkit.inputs.modelspec._source_key): a model
    in a fresh temporary folder made every session and every worker trace again what the last one traced. A folder
    whose files no longer match the hashes it was made with (a test wrote into it) is made again."""
    from toolkit import cache
    from toolkit.run import tiny

    versions = [f"{p}={cache.installed_version(p)}" for p in ("tokenizers", "safetensors")]
    key = hashlib.sha256(json.dumps([name, options, cache.fingerprint(tiny.__name__), versions], sort_keys=True)
                         .encode()).hexdigest()[:16]
    folder = SHARED_MODELS / f"{name}-{key}"
    made = _files_hash(folder)
    if made is not None and made == _read(folder / _MADE_WITH):
        return folder
    SHARED_MODELS.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=SHARED_MODELS))
    tiny.make_tiny_model(name, building, **options)
    (building / _MADE_WITH).write_text(_files_hash(building))
    stale = SHARED_MODELS / f".stale-{key}-{os.getpid()}"
    with contextlib.suppress(OSError):
        folder.rename(stale)  # a folder a test wrote into: out of the way, so the new one takes its name
    shutil.rmtree(stale, ignore_errors=True)
    try:
        building.rename(folder)
    except OSError:  # the other worker made it first: the same bytes
        shutil.rmtree(building, ignore_errors=True)
    return folder


_MADE_WITH = "made_with.sha256"


def _files_hash(folder: Path) -> str | None:
    if not folder.is_dir():
        return None
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != _MADE_WITH):
        h.update(f"{path.relative_to(folder)}\0".encode() + path.read_bytes())
    return h.hexdigest()


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    """Llama, 2 layers, hidden 64, 256 positions, random weights, a 512-token BPE tokenizer trained locally."""
    import transformers.models.llama.modeling_llama  # noqa: F401  (in the heap frozen below, as if made here)

    model_dir = shared_tiny_model("llama", layers=2, hidden=64, corpus_chars=100_000)
    _freeze_heap()
    return model_dir


@pytest.fixture(scope="session")
def tiny_reward_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """tiny_llama_dir's Llama as a reward model, as TRL's GRPOTrainer loads one by name: LlamaForSequenceClassification,
    one label, 1 decoder layer (the policy has 2), random weights, the policy's tokenizer with its pad token set."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("tiny-reward")
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    config = AutoConfig.from_pretrained(tiny_llama_dir, num_labels=1, num_hidden_layers=1)
    config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_gpt2_dir() -> Path:
    return shared_tiny_model("gpt2", layers=2, hidden=64, corpus_chars=100_000)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """train.txt + validation.txt of standard-library docstrings (about 60 KB)."""
    from toolkit.run import tiny

    return tiny.write_corpus(tmp_path_factory.mktemp("corpus"), max_chars=60_000)


class TrainRun:
    """One finished `toolkit.train` run: exit code, output, and what each rank reported."""

    def __init__(self, proc, output: Path, summary_dir: Path):
        from toolkit.train.hf_runner import read_rank_summaries

        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.output = output
        self.ranks = read_rank_summaries(summary_dir)

    def losses(self, rank: int = 0) -> dict[int, float]:
        """Training loss by optimizer step (logging every step)."""
        return {e["step"]: e["loss"] for e in self.ranks[rank]["log_history"] if "loss" in e}

    def grad_norms(self, rank: int = 0) -> dict[int, float]:
        """Gradient norm by optimizer step, before clipping (logging every step)."""
        return {e["step"]: e["grad_norm"] for e in self.ranks[rank]["log_history"] if "grad_norm" in e}

    def check(self) -> "TrainRun":
        assert self.returncode == 0, f"training failed ({self.returncode}):\n{self.stdout[-3000:]}\n{self.stderr[-6000:]}"
        return self


@pytest.fixture(scope="session")
def run_training(tmp_path_factory):
    """Emit a plan's files and run toolkit.train on it: `accelerate launch` for several processes, plain python
    for one. Returns a TrainRun; pass the same `output` twice (with --resume) to continue a run. Each launch
    rendezvouses on a port free when it starts (launch_command), so runs side by side never meet."""
    from toolkit.run.launcher import emit_plan_files, launch_command

    def run(plan, name: str, *train_argv: str, output: Path | None = None, timeout: int = 300) -> TrainRun:
        base = tmp_path_factory.mktemp(name)
        plan_dir = emit_plan_files(plan, base / "plan")
        output = output or base / "out"
        summary_dir = base / "ranks"
        argv = ["--output", str(output), *train_argv]
        if plan.world_size > 1:
            command = quick_launch(launch_command(plan_dir, argv))
        else:
            command = [sys.executable, "-m", "toolkit.train", "--plan", str(plan_dir / "plan.json"), *argv]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOOLKIT_RANK_SUMMARY_DIR": str(summary_dir),
               "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        return TrainRun(proc, output, summary_dir)

    return run


@pytest.fixture(scope="session")
def runs_side_by_side(run_training):
    """run_training's runs started together and waited for: {name: (plan, name of its folder, *train_argv)} ->
    {name: TrainRun}, not checked, the keyword options (timeout) given to each. A one-process run alone leaves the
    second core idle: beside a 2-rank run, or another one-process run, it fills it (a module's xdist_group runs its
    tests one after the other on one of CI's two workers)."""
    from concurrent.futures import ThreadPoolExecutor

    def start(runs: dict[str, tuple], **options) -> dict[str, TrainRun]:
        with ThreadPoolExecutor(max_workers=len(runs)) as pool:
            futures = {name: pool.submit(run_training, *run, **options) for name, run in runs.items()}
        return {name: future.result() for name, future in futures.items()}

    return start


@pytest.fixture(scope="session")
def runs_by_name(runs_side_by_side):
    """A module's runs, each started when a test first asks for it by name, kept, and checked:
    `get = runs_by_name(arguments, together=[("ref", "ddp")], timeout=600)`, where arguments(name) gives
    run_training's arguments (plan, folder name, *train_argv); the names of a group in `together` start side by side
    (runs_side_by_side) when one of them is asked for."""

    def make(arguments, together=(), **options):
        cache: dict[str, TrainRun] = {}

        def get(name: str) -> TrainRun:
            if name not in cache:
                names = next((group for group in together if name in group), (name,))
                cache.update(runs_side_by_side({n: arguments(n) for n in names}, **options))
            return cache[name].check()

        return get

    return make


@pytest.fixture
def train_in_process(tmp_path_factory, capsys):
    """toolkit.train's entry (`python -m toolkit.train`'s main) called in this process, for runs that stop at bad
    input: the same TrainRun as run_training (exit code, stdout, stderr), without starting an interpreter. The
    environment and accelerate's shared state are put back as they were."""
    from types import SimpleNamespace

    from accelerate.state import AcceleratorState, PartialState

    from toolkit.run.launcher import emit_plan_files
    from toolkit.train.__main__ import main

    def run(plan, name: str, *train_argv: str, output: Path | None = None) -> TrainRun:
        base = tmp_path_factory.mktemp(name)
        plan_dir = emit_plan_files(plan, base / "plan")
        output = output or base / "out"
        summary_dir = base / "ranks"
        fresh_state = not PartialState._shared_state
        environ = dict(os.environ)
        os.environ["TOOLKIT_RANK_SUMMARY_DIR"] = str(summary_dir)
        capsys.readouterr()
        try:
            code = main(["--plan", str(plan_dir / "plan.json"), "--output", str(output), *train_argv])
        finally:
            os.environ.clear()
            os.environ.update(environ)
            if fresh_state:
                AcceleratorState._reset_state(reset_partial_state=True)
        captured = capsys.readouterr()
        return TrainRun(SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err), output,
                        summary_dir)

    return run


LAUNCH_ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
"""What the tests give a `toolkit` command's processes: one thread each, Python's warnings off."""


def toolkit_here(argv: list[str], **env: str) -> tuple[int, str, str]:
    """`python -m toolkit ARGV` as toolkit.cli.main in this process (what the command calls), with LAUNCH_ENV and env
    set while it runs (the processes it starts get them too) and Python's warnings off as PYTHONWARNINGS=ignore
    turns them off in an interpreter of its own: (exit code, what it printed on stdout, on stderr). As an interpreter
    of its own, `toolkit launch` of a toolkit.train plan took 3.4 CPU-s before its launcher started (its checks
    import torch and transformers), a rehearsal's 3.7; here 0.06 and 0.33 (measured one after the other, the box
    loaded). A launch of a user's script imports neither (0.2 CPU-s): its tests keep their interpreter. What the
    processes it starts print goes to this process's descriptors, not into the strings: a test that reads that uses
    toolkit_in_process."""
    import io
    import warnings

    from toolkit.cli import main

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings(), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        warnings.simplefilter("ignore")
        for name, value in {**LAUNCH_ENV, **env}.items():
            patch.setenv(name, value)
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def toolkit_in_process(capfd, monkeypatch):
    """toolkit_here from the folder `cwd`, with what the processes it starts print captured too (capfd: they write
    to this process's descriptors): `run(*argv, cwd=folder, **env)` -> a CompletedProcess of its exit code, stdout
    and stderr, as `subprocess.run([sys.executable, "-m", "toolkit", *argv], cwd=folder, capture_output=True)`
    gives."""
    def run(*argv: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
        monkeypatch.chdir(cwd)
        capfd.readouterr()
        code, out, err = toolkit_here(list(argv), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", **env)
        done = capfd.readouterr()
        return subprocess.CompletedProcess(["toolkit", *argv], code, out + done.out, err + done.err)

    return run
