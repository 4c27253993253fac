"""Shared fixtures: small real bundles on disk, the CLI, and isolation of global switches.

Recording and replaying change process-wide state (deterministic algorithms,
thread count, ``CUBLAS_WORKSPACE_CONFIG``...); every test gets that state back
as it found it, so test order never matters.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sdcreplay.capture import comparable, determinism

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"  # where the helper scripts beside the test folders live

# One intra-op thread, here and in every process the tests start (CLI, device
# workers inherit the environment): the models are tiny, and on a 2-core CI
# machine running other work, OpenMP threads spinning against each other make
# a step 5-10x slower. Set OMP_NUM_THREADS to choose otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor's on-disk cache reuses a C++ kernel compiled under another ATen CPU capability
# (vectorized code against scalar headers: "at::vec has not been declared") when a run sets
# ATEN_CPU_CAPABILITY: one cache per capability keeps the compiled digest's tests independent of
# what ran on this machine before.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    os.path.join(
        tempfile.gettempdir(),
        f"sdcreplay-inductor-{os.environ.get('ATEN_CPU_CAPABILITY') or 'native'}",
    ),
)
# Bundles are signed with a secret of the tests' own, never the person's (see trust.py); one
# for all the pytest-xdist workers of a run, which share what one of them recorded (made_once).
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
if _RUN:
    os.environ["SDCREPLAY_HOME"] = os.path.join(tempfile.gettempdir(), f"sdcreplay-home-{_RUN}")
    os.makedirs(os.environ["SDCREPLAY_HOME"], mode=0o700, exist_ok=True)
else:
    os.environ["SDCREPLAY_HOME"] = tempfile.mkdtemp(prefix="sdcreplay-home-")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Small enough that a step takes milliseconds and a bundle ~100 KiB.
SMALL = {"layers": 1, "dim": 32, "heads": 2, "seq_len": 8, "batch_size": 2, "vocab": 64}
SMALL_MOE = {**SMALL, "experts": 2, "top_k": 1}
SMALL_ARGS = [arg for key, value in SMALL.items() for arg in ("-a", f"{key}={value}")]


def tiny_llama_recorder(path: Path, kwargs: dict = SMALL, **recorder_kwargs):
    """A user's loop set-up: builtin tiny-llama (seed 0) and a Recorder over it at ``path``;
    returns (workload, recorder)."""
    from sdcreplay import Recorder
    from sdcreplay.workload.definition import build_workload

    kwargs = dict(kwargs, seed=0)
    workload = build_workload("builtin:tiny-llama", kwargs)
    recorder = Recorder(
        path,
        workload="builtin:tiny-llama",
        model=workload.model,
        optimizer=workload.optimizer,
        workload_kwargs=kwargs,
        **recorder_kwargs,
    )
    return workload, recorder


def wrapped_as(workload, wrapper: str):
    """A workload's model wrapped as trainers wrap it, in place: each block of tiny-llama in
    an activation-checkpoint wrapper (``checkpoint``, TorchTitan's), or the whole model in
    DistributedDataParallel (``ddp``; a process group first: ``lone_rank``)."""
    if wrapper == "checkpoint":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        layers = workload.model.layers
        for position, block in enumerate(layers):
            layers[position] = checkpoint_wrapper(block)
    else:
        assert wrapper == "ddp", wrapper
        workload.model = torch.nn.parallel.DistributedDataParallel(workload.model)
    return workload


def ring_recorder(workload, path: Path, **options):
    """A ring Recorder of a small tiny-llama workload's last 4 steps."""
    from sdcreplay import Recorder

    return Recorder(
        path,
        "builtin:tiny-llama",
        workload.model,
        workload.optimizer,
        state=workload.state,
        workload_kwargs=dict(SMALL),
        ring=4,
        **options,
    )


@contextlib.contextmanager
def preserved_global_state() -> Iterator[None]:
    """Put back torch's determinism switches, thread count and the switch env vars."""
    saved = {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "precision": torch.get_float32_matmul_precision(),
        "threads": torch.get_num_threads(),
    }
    env = {
        name: os.environ.get(name)
        for name in (*determinism.SWITCH_ENV_VARS, *comparable.PINNED_ENV.values())
    }
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved["deterministic"], warn_only=saved["warn_only"])
        torch.backends.cudnn.deterministic = saved["cudnn_deterministic"]
        torch.backends.cudnn.benchmark = saved["cudnn_benchmark"]
        torch.backends.cuda.matmul.allow_tf32 = saved["matmul_tf32"]
        torch.backends.cudnn.allow_tf32 = saved["cudnn_tf32"]
        torch.set_float32_matmul_precision(saved["precision"])
        if torch.get_num_threads() != saved["threads"]:
            torch.set_num_threads(saved["threads"])
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(autouse=True)
def _isolate_global_switches() -> Iterator[None]:
    with preserved_global_state():
        yield


def made_once(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], object]) -> Path:
    """The folder ``name`` that ``make(folder)`` fills once for the whole test run: under
    pytest-xdist the first worker to ask makes it, and the others wait for it and share it
    (a recorded job takes a minute of the suite's two cores; each worker recording its own
    doubles that). The folder is theirs to read, not to change."""
    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    folder = root / f"made-once-{name}"
    with open(root / f"made-once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".made").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (folder / ".made").touch()
    return folder


@pytest.fixture(scope="session")
def _small_bundle_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Recorded once per session: 2 steps of a 1-layer tiny-llama (embedded state)."""
    from sdcreplay import record

    out = tmp_path_factory.mktemp("template") / "small.bundle"
    with preserved_global_state():
        record("builtin:tiny-llama", out, steps=2, seed=0, kwargs=dict(SMALL))
    return out


@pytest.fixture
def small_bundle(tmp_path: Path, _small_bundle_template: Path) -> Path:
    """A private copy of the session's small bundle, free to damage."""
    target = tmp_path / "small.bundle"
    shutil.copytree(_small_bundle_template, target)
    return target


@pytest.fixture
def cli():
    """Invoke the typer app in-process: ``cli(*args, env=...)`` -> Result with .stdout/.stderr."""
    from sdcreplay.cli import app

    runner = CliRunner()

    def invoke(*args: str, env: dict | None = None):
        return runner.invoke(
            app, [str(arg) for arg in args], env={"SDCREPLAY_DEBUG": None, **(env or {})}
        )

    return invoke


def _console_script() -> str:
    beside = Path(sys.executable).parent / "sdcreplay"
    if beside.is_file():
        return str(beside)
    found = shutil.which("sdcreplay")
    if found is None:
        pytest.skip("the sdcreplay console script is not installed")
    return found


def json_from_elsewhere(elsewhere: Path, *args: str, code: int, env: dict[str, str]) -> dict:
    """The console script run as a user runs it from a directory of theirs (``elsewhere``),
    in the shell ``env``, with --json: its exit code checked, its JSON returned."""
    done = subprocess.run(
        [_console_script(), *args, "--json"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == code, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="session")
def sdcreplay_exe() -> str:
    return _console_script()


@pytest.fixture
def run_exe(tmp_path: Path):
    """Run the installed ``sdcreplay`` console script in a real process (cwd: tmp_path)."""
    exe = _console_script()

    def run(
        *args: str, env: dict | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        full_env = {**os.environ, **(env or {})}  # a None value removes the variable
        full_env = {name: value for name, value in full_env.items() if value is not None}
        full_env.pop("SDCREPLAY_DEBUG", None)
        return subprocess.run(
            [exe, *[str(arg) for arg in args]],
            cwd=tmp_path,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


def process_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of process ``pid`` from /proc (state "Z": a zombie, ended but not
    reaped); None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def process_ended(pid: int) -> bool:
    stat = process_stat(pid)
    return stat is None or stat[0] == "Z"


def run_torchrun(script: Path, nproc: int, *args: str, timeout: float = 240):
    """Start ``script`` on ``nproc`` ranks as torchrun does (gloo on this machine)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", str(nproc), str(script), *args]
    return subprocess.run(
        command, cwd=script.parent, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="session")
def ddp_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Recorded once per session by a user's script under torchrun: 2 ranks of DDP tiny-llama,
    2 steps, then replayed in the same ranks (tests/job_script.py). (job bundle, results)."""

    def make(root: Path) -> None:
        script = root / "train.py"
        shutil.copy(TESTS / "job_script.py", script)
        (root / "results").mkdir()
        done = run_torchrun(script, 2, str(root / "job.bundle"), str(root / "results"), "ddp")
        assert done.returncode == 0, done.stderr[-3000:]

    root = made_once(tmp_path_factory, "ddp-job", make)
    return root / "job.bundle", root / "results"


@pytest.fixture(scope="session")
def sharded_job(tmp_path_factory: pytest.TempPathFactory):
    """``sharded_job(parallel, nproc)``: the job bundle tests/sharded_script.py records under
    torchrun (``fsdp2``, ``tp``, ``fsdp2+tp``), once per session for each layout."""

    def record(parallel: str, nproc: int) -> Path:
        def make(root: Path) -> None:
            script = root / "train.py"
            shutil.copy(TESTS / "sharded_script.py", script)
            done = run_torchrun(script, nproc, str(root / "job.bundle"), parallel, timeout=300)
            assert done.returncode == 0, done.stderr[-3000:]

        return made_once(tmp_path_factory, parallel.replace("+", "-"), make) / "job.bundle"

    return record


@pytest.fixture(scope="session")
def script_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A script-mode job, once per run: tests/loops/nanogpt_train.py (a flat nanoGPT-style
    script, its Recorder given no workload) under torchrun, 2 gloo ranks, DDP."""

    def make(root: Path) -> None:
        loop = TESTS / "loops" / "nanogpt_train.py"
        done = run_torchrun(loop, 2, f"--bundle={root / 'job.bundle'}", timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]

    return made_once(tmp_path_factory, "script-job", make) / "job.bundle"


@pytest.fixture(scope="session")
def compiled_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A compiled job, once per run: 2 DDP ranks of tests/compiled_loop.py's block-compiled
    model (CPU Inductor), 2 steps at the boundary level (``make_workload`` of that file)."""

    def make(root: Path) -> None:
        from sdcreplay.bundle import trust
        from sdcreplay.recording.job import record_job

        ref = f"{TESTS / 'compiled_loop.py'}:make_workload"
        with trust.granting([ref]), preserved_global_state():
            summary = record_job(
                ref,
                root / "job.bundle",
                nproc=2,
                steps=2,
                kwargs={"compile": "blocks", "parallel": "ddp"},
                signature="boundary",
            )
        assert summary.exit_code == 0

    return made_once(tmp_path_factory, "compiled-job", make) / "job.bundle"


@dataclass(frozen=True)
class Ran:
    """One ``sdcreplay`` command's run: what its ``--out`` named, its exit code and output."""

    out: Path
    code: int
    stdout: str
    stderr: str

    def json(self) -> dict:
        return json.loads(self.stdout)


@pytest.fixture(scope="session")
def ran_once(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Ran]:
    """``ran_once(*args)``: ``sdcreplay ARGS --out DIR/out --json`` run in-process once for the
    whole test run, by whichever test module asks first (made_once); the same arguments from any
    module get that run. For what several modules prove things about (a recorded job, a bisect
    report of it): its ``out`` is theirs to read, not to change."""

    def run(*args: object) -> Ran:
        words = [str(arg) for arg in args]
        key = hashlib.sha256("\0".join(words).encode()).hexdigest()[:16]

        def make(root: Path) -> None:
            from sdcreplay.cli import app

            with preserved_global_state():
                done = CliRunner().invoke(
                    app,
                    [*words, "--out", str(root / "out"), "--json"],
                    env={"SDCREPLAY_DEBUG": None, "SDCREPLAY_INJECT": None},
                )
            ran = {"code": done.exit_code, "stdout": done.stdout, "stderr": done.stderr}
            (root / "ran.json").write_text(json.dumps(ran))

        root = made_once(tmp_path_factory, f"{words[0]}-{key}", make)
        return Ran(root / "out", **json.loads((root / "ran.json").read_text()))

    return run


@pytest.fixture(scope="session")
def builtin_job(ran_once) -> Callable[..., Ran]:
    """``builtin_job(parallel, nproc=2)``: ``sdcreplay record builtin:tiny-llama --nproc N
    --steps 2`` of the small tiny-llama with ``-a parallel=PARALLEL`` (ddp, fsdp2, tp, ...),
    once for the whole run: its ``out`` is the job bundle."""

    def record(parallel: str, nproc: int = 2) -> Ran:
        ran = ran_once(
            "record", "builtin:tiny-llama", "--nproc", nproc, "--steps", "2", *SMALL_ARGS,
            "-a", f"parallel={parallel}",
        )  # fmt: skip
        assert ran.code == 0, ran.stderr[-3000:]
        return ran

    return record


# A bit of rank 1's first backward matmul of step 1 (the head's), planted for cpu:1.
RANK_FAULT = (
    "kind=bitflip,op=aten.mm,phase=backward,step=1,nth=0,index=3,bit=20,rank=1,device=cpu:1"
)


@pytest.fixture(scope="session")
def rank_bisect(ran_once) -> Callable[..., dict]:
    """``rank_bisect(job, spec, *options, rank=1)``: ``bisect JOB --rank R OPTIONS`` of step 1
    on cpu:1 against cpu:0 with ``spec`` planted, once for the whole run: its JSON report.
    Every module that bisects the same rank of the same job with the same spec shares it."""

    def bisect(job: Path, spec: str, *options: str, rank: int = 1) -> dict:
        ran = ran_once(
            "bisect", job, "--rank", rank, *options, "--suspect", "cpu:1", "--reference",
            "cpu:0", "--step", "1", "--trust-workload", "--inject", spec, "--no-ledger",
        )  # fmt: skip
        assert ran.code == 1, ran.stderr[-3000:]
        return ran.json()

    return bisect


TICKET_CALL = "kind=bitflip,op=aten.mm,module=layers.0.attn.wq,phase=forward,step=1"
TICKET_FAULTS = ["index=5,bit=22", "index=0,bit=3", "index=2,bit=30"]


@pytest.fixture(scope="session")
def tickets(tmp_path_factory: pytest.TempPathFactory, _small_bundle_template: Path) -> list[Path]:
    """Three tickets of three defect classes from real runs: one bisect of the small bundle names
    the ``layers.0.attn.wq`` matmul of step 1 on cpu:1, and three minimize runs of that report,
    each with another planted fault (element and bit), measure and shrink it."""
    from sdcreplay.bisect.localize import bisect
    from sdcreplay.minimize.driver import minimize

    def make(root: Path) -> None:
        bundle = root / "run.bundle"
        shutil.copytree(_small_bundle_template, bundle)
        with preserved_global_state():
            found = bisect(
                bundle,
                suspect="cpu:1",
                reference="cpu:0",
                step=1,
                inject=[f"{TICKET_CALL},{TICKET_FAULTS[0]},device=cpu:1"],
                ledger=False,
            )
            assert found.verdict == "divergence" and found.findings["op"] == "aten.mm.default"
            for number, fault in enumerate(TICKET_FAULTS):
                made = minimize(
                    found.report,
                    trials=20,
                    good_trials=2,
                    inject=[f"{TICKET_CALL},{fault},device=cpu:1"],
                    out=root / f"ticket-{number}",
                    ledger=False,
                )
                assert made.reproduced and Path(made.ticket) == root / f"ticket-{number}"

    root = made_once(tmp_path_factory, "tickets", make)
    return [root / f"ticket-{number}" for number in range(len(TICKET_FAULTS))]


@pytest.fixture
def lone_rank():
    """This process as the one rank of a gloo group: real c10d calls, completed on gloo's
    thread."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def read_only() -> Iterator:
    """``read_only(directory)`` makes an existing directory refuse every write for the rest of
    the test, root's too: a read-only bind mount of it over itself (``chmod 555`` stops only
    other users than root, so it is the way for a non-root run); skipped where neither works."""
    mounted: list[Path] = []
    chmodded: list[Path] = []

    def make(directory: Path) -> Path:
        if os.geteuid() != 0:
            directory.chmod(0o555)
            chmodded.append(directory)
            return directory
        path = str(directory)
        for command in (["--bind", path, path], ["-o", "remount,bind,ro", path]):
            done = subprocess.run(["mount", *command], capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"running as root, and no read-only mount here: {done.stderr.strip()}")
            if command[0] == "--bind":
                mounted.append(directory)
        return directory

    yield make
    for directory in reversed(mounted):
        subprocess.run(["umount", str(directory)], check=True)
    for directory in chmodded:
        directory.chmod(0o755)


# The ledger's tests run against SQLite always and against PostgreSQL when a server is given
# (.ci/run starts one and sets this); in CI (CI=true) they must run, never skip.
POSTGRES_ENV = "SDCREPLAY_TEST_POSTGRES"


def pytest_report_header(config) -> str:
    url = os.environ.get(POSTGRES_ENV)
    if url:
        return f"ledger backends: sqlite and postgresql ({url})"
    return (
        f"ledger backends: sqlite only; the postgresql tests skip ({POSTGRES_ENV} is not set; "
        ".ci/run starts a server)"
    )


def _postgres_schema(url: str):
    """A fresh schema on the test server, and a URL whose connections use it."""
    import uuid

    import psycopg

    schema = f"ledger_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute(f"CREATE SCHEMA {schema}")
    separator = "&" if "?" in url else "?"
    return schema, f"{url}{separator}options=-csearch_path%3D{schema}"


@contextlib.contextmanager
def _empty_ledger(backend: str, tmp_path: Path) -> Iterator[str]:
    """A new, empty ledger: a SQLite file, or a schema of its own on the PostgreSQL server
    ``SDCREPLAY_TEST_POSTGRES`` names (skipped without one, failed without one in CI)."""
    if backend == "sqlite":
        yield str(tmp_path / "ledger.sqlite")
        return
    url = os.environ.get(POSTGRES_ENV)
    if not url:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {POSTGRES_ENV} is not set: .ci/run must start PostgreSQL")
        pytest.skip(f"no PostgreSQL server given ({POSTGRES_ENV}=postgresql://... runs these)")
    import psycopg

    schema, scoped = _postgres_schema(url)
    try:
        yield scoped
    finally:
        with psycopg.connect(url, autocommit=True) as connection:
            connection.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request, tmp_path: Path) -> Iterator[str]:
    """A new, empty ledger on each backend, one test each."""
    with _empty_ledger(request.param, tmp_path) as url:
        yield url


@pytest.fixture
def ledger_urls(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A new, empty ledger on each backend at once, for a test that shares one run between
    them (the PostgreSQL one left out, and said so, where no server is given outside CI)."""
    with contextlib.ExitStack() as stack:
        urls = {"sqlite": stack.enter_context(_empty_ledger("sqlite", tmp_path))}
        if os.environ.get(POSTGRES_ENV) or os.environ.get("CI") == "true":
            urls["postgresql"] = stack.enter_context(_empty_ledger("postgresql", tmp_path))
        else:
            print(f"no PostgreSQL server given ({POSTGRES_ENV}): SQLite only")
        yield urls


def pytest_terminal_summary(terminalreporter) -> None:
    """One line, even under -q, saying which ledger backends the run tested and how it went."""
    counts: dict[str, dict[str, int]] = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            nodeid = getattr(report, "nodeid", "")
            counted = report.when == "call" or outcome in ("skipped", "error")
            for backend in ("sqlite", "postgresql"):
                if counted and f"[{backend}" in nodeid:
                    tally = counts.setdefault(backend, {})
                    tally[outcome] = tally.get(outcome, 0) + 1
    if counts:
        terminalreporter.write_line(
            "ledger backends: "
            + "; ".join(
                f"{backend}: " + ", ".join(f"{n} {outcome}" for outcome, n in tally.items())
                for backend, tally in counts.items()
            )
        )


def rewrite_manifest(path: Path, edit, rehash: bool = True) -> None:
    """Hand-edit the manifest; ``rehash`` keeps its own SHA-256 valid so the validator is what is
    tested."""
    from sdcreplay.bundle.manifest import MANIFEST, MANIFEST_DIGEST, manifest_digest

    manifest = json.loads((path / MANIFEST).read_text())
    edit(manifest)
    if rehash and isinstance(manifest, dict):
        manifest[MANIFEST_DIGEST] = manifest_digest(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest, indent=2))


def planted(model, optimizer, spec: str | None, step: int, label: str = "cpu"):
    """The operator mode of a step with fault ``spec`` planted (None: a clean step)."""
    from sdcreplay.capture.faults import Injector, parse_specs
    from sdcreplay.capture.operators import OperatorMode

    if spec is None:
        return contextlib.nullcontext()
    injector = Injector(parse_specs([spec], include_env=False), label)
    return OperatorMode(model, optimizer, [injector], step)


# The docs' runs take minutes (tests/docs/test_docs.py): the ones the chosen tests need start
# as soon as the suite has chosen them, and run beside the tests before them (each run is mostly
# one process at a time, and so are most other tests, on a machine of two cores or more). Here,
# not in a tests/docs/conftest.py: the test modules' `from conftest import ...` must find this one.
def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    wanted: dict[object, set[str]] = {}
    for item in session.items:
        module = getattr(item, "module", None)
        needed = getattr(module, "run_needed", None)
        if needed is not None and (name := needed(item)) is not None:
            wanted.setdefault(module, set()).add(name)
    for module, names in wanted.items():
        module.start_runs(names)  # type: ignore[attr-defined]


def pytest_sessionfinish(session: pytest.Session) -> None:
    doccheck = sys.modules.get("doccheck")  # tests/docs' runner, where the docs tests ran
    if doccheck is not None:
        doccheck.stop_runs()
