"""Stand-ins for a cluster's commands, so that the emitted multi-node scripts run as two nodes on this one machine.

`python tests/cluster_shims.py NAME ARGS` behaves as NAME would; `install(folder)` writes one small wrapper per name
into folder, to put first on PATH. Every "node" is this machine under its own loopback address (127.0.0.1,
127.0.0.2, ...: Linux routes all of 127.0.0.0/8 to the loopback device), so host names are real, distinct and
resolvable, and a rendezvous on the first of them works as it would across machines.

  sbatch    reads the script's #SBATCH lines (up to its first command) and its own options, allocates --nodes
            loopback hosts, runs a copy of the script (as slurmd does, from a spool folder) in the submit folder
            with SLURM_JOB_NODELIST (a hostlist expression, "127.0.0.[1-2]"), SLURM_JOB_NUM_NODES,
            SLURM_SUBMIT_DIR, SLURM_GPUS_ON_NODE ..., its output in slurm-JOBID.out; returns the job's exit code
            (as `sbatch --wait` does).
  srun      starts --ntasks-per-node tasks on every node of the allocation at once, each with its own
            SLURM_NODEID / SLURM_PROCID / SLURM_LOCALID / SLURMD_NODENAME, executing the argv as given (no shell);
            --kill-on-bad-exit=1 stops the other tasks when one fails; exits with the highest task exit code.
  scontrol  `show hostnames [LIST]`: a hostlist expression expanded one host per line.
  ssh       `ssh [OPTIONS] HOST COMMAND...`: runs the command (its words joined by spaces, as ssh does) with
            bash -c in a login-like environment (HOME, USER, PATH, LANG only); a host that is not this machine is
            "not reachable" (exit 255).
  pdsh      `pdsh [-S] [-f N] -w H1,H2 COMMAND...`: the command on every host at once through the ssh stand-in,
            with %n replaced by the host's index and %h by its name, output lines prefixed "HOST: "; -S exits
            with the largest remote exit code. DeepSpeed's kill command (`pkill -f ...`) is not run: on a shared
            machine it could match other people's processes.

Not modelled: SLURM's accounting, cgroups and GPU binding, real ssh (keys, host checking), pdsh's fan-out limit.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

NAMES = ("sbatch", "srun", "scontrol", "ssh", "pdsh")


def install(folder: Path) -> Path:
    """Write the wrappers (sbatch, srun, ...) into folder; returns it (put it first on PATH)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in NAMES:
        path = folder / name
        path.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))}"
                        f" {name} \"$@\"\n")
        path.chmod(0o755)
    return folder


# --- hostlists ------------------------------------------------------------------------------------------------------

def expand_hostlist(expression: str) -> list[str]:
    """SLURM's hostlist expression ("127.0.0.[1-2]", "gpu[01-03,07],login1") as host names."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]*(?:\[[^\]]*\][^,\[]*)*", expression):
        if not part:
            continue
        match = re.fullmatch(r"(.*?)\[([^\]]*)\](.*)", part)
        if match is None:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            low, _, high = item.partition("-")
            width = len(low)
            for number in range(int(low), int(high or low) + 1):
                for host in expand_hostlist(suffix) if "[" in suffix else [suffix]:
                    hosts.append(f"{prefix}{number:0{width}d}{host}")
    return hosts


def loopback_hosts(count: int) -> tuple[list[str], str]:
    """count distinct loopback addresses and their hostlist expression."""
    return [f"127.0.0.{i}" for i in range(1, count + 1)], f"127.0.0.[1-{count}]" if count > 1 else "127.0.0.1"


# --- sbatch ---------------------------------------------------------------------------------------------------------

def _options(words: list[str], valued: set[str]) -> tuple[dict[str, str], list[str]]:
    """Leading long options (--name=value, --name value for the valued ones, --flag) and what follows them."""
    options: dict[str, str] = {}
    i = 0
    while i < len(words) and words[i].startswith("-"):
        name, eq, value = words[i].lstrip("-").partition("=")
        name = {"N": "nodes", "n": "ntasks", "o": "output", "J": "job-name", "D": "chdir"}.get(name, name)
        if not eq and name in valued and i + 1 < len(words):
            value = words[i + 1]
            i += 1
        options[name] = value if (eq or name in valued) else "1"
        i += 1
    return options, words[i:]


SBATCH_VALUED = {"nodes", "ntasks", "ntasks-per-node", "gpus-per-node", "job-name", "output", "error", "chdir",
                 "time", "partition", "account", "cpus-per-task", "mem", "export"}


def sbatch_directives(script: str) -> list[str]:
    """The #SBATCH words sbatch reads: from the lines after the first, up to the first line that is not a comment
    or blank (sbatch's documented rule)."""
    words: list[str] = []
    for line in script.splitlines()[1:]:
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break
        if stripped.startswith("#SBATCH"):
            words += shlex.split(stripped[len("#SBATCH"):], comments=True)
    return words


def sbatch(argv: list[str]) -> int:
    options, rest = _options(argv, SBATCH_VALUED)
    if not rest:
        print("sbatch: error: no script given", file=sys.stderr)
        return 1
    script, script_args = Path(rest[0]), rest[1:]
    from_script, _ = _options(sbatch_directives(script.read_text()), SBATCH_VALUED)
    options = {**from_script, **options}  # the command line wins, as in sbatch
    nodes = int(options.get("nodes", "1").split("-")[0])
    hosts, nodelist = loopback_hosts(nodes)
    job_id = str(os.getpid())
    submit_dir = Path.cwd()
    spool = Path(tempfile.mkdtemp(prefix=f"slurm-spool-job{job_id}-"))
    copy = spool / "slurm_script"  # slurmd runs a copy of the script, never the submitted file
    shutil.copy(script, copy)
    copy.chmod(0o700)
    gpus = options.get("gpus-per-node", "0")
    env = {**os.environ,  # --export=ALL, sbatch's default
           "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_JOB_NAME": options.get("job-name", script.name),
           "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist, "SLURM_JOB_NUM_NODES": str(nodes),
           "SLURM_NNODES": str(nodes), "SLURM_SUBMIT_DIR": str(submit_dir), "SLURM_SUBMIT_HOST": socket.gethostname(),
           "SLURM_GPUS_ON_NODE": gpus, "SLURM_GPUS_PER_NODE": gpus, "SLURM_NODEID": "0",
           "SLURMD_NODENAME": hosts[0], "SLURM_CLUSTER_NAME": "shim",
           "SLURM_NTASKS_PER_NODE": options.get("ntasks-per-node", "1")}
    output = Path(options.get("output", "slurm-%j.out").replace("%j", job_id))
    workdir = Path(options.get("chdir", str(submit_dir)))
    print(f"Submitted batch job {job_id}", flush=True)
    try:
        with open(workdir / output if not output.is_absolute() else output, "ab") as out:
            return subprocess.run([str(copy), *script_args], cwd=workdir, env=env, stdout=out,
                                  stderr=subprocess.STDOUT).returncode
    finally:
        shutil.rmtree(spool, ignore_errors=True)


# --- srun -----------------------------------------------------------------------------------------------------------

def _wait_all(procs: list[subprocess.Popen], *, stop_on_failure: bool) -> int:
    """Wait for every process (each the leader of its own session); on the first failure, with stop_on_failure,
    SIGTERM the others' sessions (SIGKILL after 10 s). Returns the highest exit code (128 + signal for a kill)."""
    stopping_since = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return max((c if c >= 0 else 128 - c) for c in codes)
        failed = any(c not in (None, 0) for c in codes)
        if failed and stop_on_failure:
            if stopping_since is None:
                stopping_since = time.monotonic()
                _signal_all(procs, signal.SIGTERM)
            elif time.monotonic() - stopping_since > 10:
                _signal_all(procs, signal.SIGKILL)
        time.sleep(0.1)


def _signal_all(procs: list[subprocess.Popen], signum: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signum)
            except ProcessLookupError:
                pass


def _forward_stops(procs: list[subprocess.Popen]) -> None:
    def on_signal(signum, frame):
        _signal_all(procs, signal.SIGTERM)
        raise SystemExit(128 + signum)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)


def srun(argv: list[str]) -> int:
    options, command = _options(argv, {"nodes", "ntasks", "ntasks-per-node", "kill-on-bad-exit", "export",
                                       "job-name", "output", "chdir", "cpus-per-task"})
    if "SLURM_JOB_NODELIST" not in os.environ:
        print("srun: error: no allocation (SLURM_JOB_NODELIST is unset); run inside sbatch", file=sys.stderr)
        return 1
    hosts = expand_hostlist(os.environ["SLURM_JOB_NODELIST"])[:int(options.get("nodes", "0")) or None]
    per_node = int(options.get("ntasks-per-node", "1"))
    ntasks = len(hosts) * per_node
    procs: list[subprocess.Popen] = []
    _forward_stops(procs)
    for node, host in enumerate(hosts):
        for local in range(per_node):
            env = {**os.environ, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node * per_node + local),
                   "SLURM_LOCALID": str(local), "SLURM_NTASKS": str(ntasks), "SLURM_NPROCS": str(ntasks),
                   "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_STEP_NUM_NODES": str(len(hosts)),
                   "SLURM_STEP_NODELIST": os.environ["SLURM_JOB_NODELIST"], "SLURMD_NODENAME": host,
                   "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_TOPOLOGY_ADDR": host,
                   "SLURM_TASKS_PER_NODE": f"{per_node}(x{len(hosts)})"}
            procs.append(subprocess.Popen(command, env=env, start_new_session=True))  # argv as given: no shell
    return _wait_all(procs, stop_on_failure=options.get("kill-on-bad-exit", "0") not in ("0", ""))


def scontrol(argv: list[str]) -> int:
    if argv[:2] != ["show", "hostnames"]:
        print(f"scontrol shim: only `show hostnames` is modelled, not {argv}", file=sys.stderr)
        return 1
    expression = argv[2] if len(argv) > 2 else os.environ.get("SLURM_JOB_NODELIST", "")
    for host in expand_hostlist(expression):
        print(host)
    return 0


# --- ssh and pdsh ---------------------------------------------------------------------------------------------------

def _this_machine(host: str) -> bool:
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    own = set(subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split())
    return any(a.startswith("127.") or a == "::1" or a in own for a in addresses)


def _login_env() -> dict[str, str]:
    """What a fresh ssh session has: a few login variables, nothing of the caller's environment."""
    return {k: v for k, v in os.environ.items() if k in ("HOME", "USER", "LOGNAME", "PATH", "LANG", "SHELL")}


def _remote(host: str, command: str, **popen) -> subprocess.Popen | None:
    if not _this_machine(host):
        return None
    return subprocess.Popen(["bash", "-c", command], env=_login_env(), cwd=os.environ.get("HOME", "/"),
                            start_new_session=True, **popen)


def ssh(argv: list[str]) -> int:
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] in ("-o", "-p", "-i", "-l", "-F", "-J") else 1
    if i >= len(argv):
        print("usage: ssh [options] host command", file=sys.stderr)
        return 255
    host, command = argv[i].rpartition("@")[2], " ".join(argv[i + 1:])
    proc = _remote(host, command)
    if proc is None:
        print(f"ssh: connect to host {host}: not this machine (cluster_shims)", file=sys.stderr)
        return 255
    return proc.wait()


def pdsh(argv: list[str]) -> int:
    hosts: list[str] = []
    largest = False
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] == "-S":
            largest = True
        elif argv[i] == "-w":
            hosts = argv[i + 1].split(",")
            i += 1
        elif argv[i] in ("-f", "-l", "-R", "-u", "-t"):
            i += 1
        i += 1
    command = " ".join(argv[i:])
    if command.lstrip().startswith("pkill"):
        print("pdsh shim: not running DeepSpeed's `pkill -f` on a shared machine", file=sys.stderr)
        return 0
    procs, pumps = [], []
    for index, host in enumerate(hosts):
        proc = _remote(host, command.replace("%n", str(index)).replace("%h", host), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT)
        if proc is None:
            print(f"pdsh@shim: {host}: ssh exited with exit code 255", file=sys.stderr)
            _signal_all(procs, signal.SIGTERM)
            return 255
        procs.append(proc)
        pumps.append(threading.Thread(target=_prefix_lines, args=(proc.stdout, host), daemon=True))
        pumps[-1].start()
    _forward_stops(procs)
    code = _wait_all(procs, stop_on_failure=False)
    for pump in pumps:
        pump.join(timeout=5)
    return code if largest else 0


def _prefix_lines(stream, host: str) -> None:
    for line in iter(stream.readline, b""):
        sys.stdout.write(f"{host}: {line.decode(errors='replace')}")
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit({"sbatch": sbatch, "srun": srun, "scontrol": scontrol, "ssh": ssh, "pdsh": pdsh}[sys.argv[1]](
        sys.argv[2:]))
