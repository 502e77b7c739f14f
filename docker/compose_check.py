"""`make compose-check`: docker compose run for real, as a new user would, and cleaned up after.

1. docker: where the daemon is not running and this is root, install Debian's docker.io and
   docker-compose (if missing) and start dockerd, stopping it again at the end;
2. a base image: RAYFREE_BASE_IMAGE if given, else one made here from OS packages (debootstrap; no
   registry), its root file system kept in ~/.cache/rayfree between runs;
3. the project's image from the Dockerfile and the wheelhouse (`make wheelhouse`), no index;
4. run 1: the CPU profile's two nodes (head-cpu, follower-cpu) on their compose network; the head must
   report every output equal and both containers exit 0;
5. run 2: the same with a long run: `rayfree status --json` in the follower's container must show both
   nodes and all four ranks; then the follower container is killed (`docker kill`) mid-run: the head
   must fail naming node 1 within the heartbeat timeout and exit non-zero;
6. remove every container, network and image it made (also when a step fails).

The compose network is `internal`: no traffic leaves this machine. Prints one line per stage and the
wall time; exits non-zero on the first check that fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rayfree"
SUITE = "bookworm"
MIRROR = os.environ.get("RAYFREE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
HEARTBEAT_TIMEOUT_S = 3.0  # docker-compose.yml's RAYFREE_HEARTBEAT_TIMEOUT_S
TAG = f"rfcheck{os.getpid()}"

T0 = time.monotonic()


def say(text: str) -> None:
    print(f"[compose-check {time.monotonic() - T0:6.1f}s] {text}", flush=True)


class CheckFailed(Exception):
    pass


def run(
    *argv: str, timeout: float = 600, check: bool = True, capture: bool = True, **kw
) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(argv, timeout=timeout, text=True, capture_output=capture, **kw)
    except subprocess.TimeoutExpired as e:
        raise CheckFailed(f"`{' '.join(argv)}` did not finish within {timeout:.0f}s") from e
    if check and r.returncode != 0:
        out = ((r.stdout or "") + (r.stderr or ""))[-3000:] if capture else ""
        raise CheckFailed(f"`{' '.join(argv)}` exited {r.returncode}:\n{out}")
    return r


def docker_up() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0


class Docker:
    """The daemon, started here if it was not running (and stopped again by `close`)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.log = None

    def ensure(self) -> None:
        if shutil.which("docker") and docker_up():
            say("docker daemon already running: using it")
            return
        if os.geteuid() != 0:
            raise CheckFailed(
                "no docker daemon answers, and only root may install and start one here: start "
                "dockerd (or run this as root)"
            )
        missing = [
            pkg
            for pkg, exe in (("docker.io", "dockerd"), ("docker-compose", "docker-compose"))
            if not shutil.which(exe)
        ]
        if missing:
            say(f"installing {' '.join(missing)} from the OS packages")
            run("apt-get", "update", "-q", timeout=600)
            run(
                "apt-get",
                "install",
                "-y",
                "-q",
                *missing,
                timeout=900,
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            )
        if docker_up():
            say("docker daemon running (started by its package)")
            return
        say("starting dockerd")
        self.log = tempfile.NamedTemporaryFile("w+", prefix="rf-dockerd-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(["dockerd"], stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while not docker_up():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise CheckFailed(f"dockerd did not come up:\n{self.log.read()[-3000:]}")
            time.sleep(0.5)

    def close(self) -> None:
        if self.proc is None:
            return
        say("stopping the dockerd this check started")
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if self.log is not None:
            self.log.close()
            os.unlink(self.log.name)


def compose_cmd() -> list[str]:
    """`docker compose` (v2) where the plugin is there, else `docker-compose` (v1, Debian's)."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise CheckFailed("neither `docker compose` nor `docker-compose` is installed")


def base_rootfs() -> Path:
    """A Debian root file system with python3 and venv, as a tar (made once with debootstrap, then kept)."""
    tar = CACHE / f"base-{SUITE}-python.tar"
    if tar.exists():
        return tar
    if not shutil.which("debootstrap"):
        say("installing debootstrap from the OS packages")
        run(
            "apt-get",
            "install",
            "-y",
            "-q",
            "debootstrap",
            timeout=600,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rf-rootfs-", dir=CACHE) as d:
        say(f"making a {SUITE} base from OS packages (debootstrap, about a minute)")
        run(
            "debootstrap",
            "--variant=minbase",
            "--include=python3,python3-venv,iproute2,ca-certificates",
            SUITE,
            d,
            MIRROR,
            timeout=1200,
        )
        shutil.rmtree(Path(d) / "var/cache/apt/archives", ignore_errors=True)
        part = tar.with_suffix(".part")
        run("tar", "-C", d, "-cf", str(part), ".", timeout=600)
        part.rename(tar)
    return tar


class Check:
    def __init__(self) -> None:
        self.compose = compose_cmd()
        self.images: list[str] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="rf-compose-"))
        self.secret = self.tmp / "rayfree.secret"
        self.env = {
            **os.environ,
            "RAYFREE_SECRET_FILE": str(self.secret),
            "RAYFREE_IMAGE": f"rayfree-check:{TAG}",
            "COMPOSE_PROJECT_NAME": TAG,
            "DOCKER_BUILDKIT": "0",
        }
        run(sys.executable, "-m", "rayfree.cli", "keygen", str(self.secret), cwd=ROOT)

    def images_made(self) -> None:
        base = os.environ.get("RAYFREE_BASE_IMAGE")
        if not base:
            base = f"rayfree-base-check:{TAG}"
            tar = base_rootfs()
            with open(tar, "rb") as f:
                run("docker", "import", "-", base, stdin=f, timeout=600)
            self.images.append(base)
            say(f"base image {base} imported from {tar}")
        if not any(ROOT.glob("docker/wheelhouse/rayfree-*.whl")):
            raise CheckFailed("docker/wheelhouse is empty: run `make wheelhouse` first (`make compose-check` does)")
        say("building the image from the Dockerfile and the wheelhouse (no index)")
        self.images.append(self.env["RAYFREE_IMAGE"])
        run(
            "docker",
            "build",
            "-q",
            "--build-arg",
            f"BASE_IMAGE={base}",
            "-t",
            self.env["RAYFREE_IMAGE"],
            ".",
            cwd=ROOT,
            env=self.env,
            timeout=1200,
        )

    def dc(self, *args: str, files: list[Path] = (), timeout: float = 300, check: bool = True):
        fs = [x for f in [ROOT / "docker-compose.yml", *files] for x in ("-f", str(f))]
        return run(
            *self.compose,
            *fs,
            "--project-directory",
            str(ROOT),
            *args,
            env=self.env,
            cwd=ROOT,
            timeout=timeout,
            check=check,
        )

    def container(self, service: str, files: list[Path] = ()) -> str:
        cid = self.dc("ps", "-q", service, files=files).stdout.strip()
        if not cid:
            raise CheckFailed(f"no container for service {service}")
        return cid

    @staticmethod
    def wait_exit(cid: str, timeout: float) -> int:
        return int(run("docker", "wait", cid, timeout=timeout).stdout.strip())

    @staticmethod
    def logs(cid: str) -> str:
        r = run("docker", "logs", "-t", cid, check=False)
        return "\n".join(sorted((r.stdout + r.stderr).splitlines()))  # stdout and stderr, in time order

    def run_clean(self) -> None:
        say("run 1: docker compose --profile cpu up head-cpu follower-cpu")
        self.dc("--profile", "cpu", "up", "-d", "--no-build", "head-cpu", "follower-cpu", timeout=300)
        head, follower = self.container("head-cpu"), self.container("follower-cpu")
        codes = {"head-cpu": self.wait_exit(head, 300), "follower-cpu": self.wait_exit(follower, 120)}
        hl, fl = self.logs(head), self.logs(follower)
        print(_indent(hl), flush=True)
        self.dc("--profile", "cpu", "down", "-v", "--remove-orphans", timeout=120)
        equal = [ln for ln in hl.splitlines() if "outputs equal to 1-process model" in ln]
        if codes != {"head-cpu": 0, "follower-cpu": 0}:
            raise CheckFailed(f"run 1: exit codes {codes}; follower log:\n{_indent(fl)}")
        if not equal or equal[-1].split()[-1] != "200":
            raise CheckFailed(f"run 1: the head did not report 200/200 outputs equal: {equal}")
        noisy = [ln for ln in (hl + fl).splitlines() if "Failed to initialize NumPy" in ln or "Warning" in ln]
        if noisy:
            raise CheckFailed(f"run 1: warnings in the container logs: {noisy[:3]}")
        say(f"run 1 passed: 200/200 outputs equal, both containers exited 0 ({equal[-1].split(' ', 1)[1].strip()})")

    def run_killed(self) -> None:
        override = self.tmp / "long-run.yml"
        override.write_text('services:\n  head-cpu:\n    environment:\n      RAYFREE_DEMO_STEPS: "1000000"\n')
        files = [override]
        say("run 2: the same, a long run; the follower is killed mid-run")
        self.dc("--profile", "cpu", "up", "-d", "--no-build", "head-cpu", "follower-cpu", files=files, timeout=300)
        head, follower = self.container("head-cpu", files), self.container("follower-cpu", files)
        deadline = time.monotonic() + 240
        while "ready after" not in self.logs(head) and " ready" not in self.logs(head):
            if time.monotonic() > deadline or self._exited(head):
                raise CheckFailed(f"run 2: the head never became ready:\n{_indent(self.logs(head))}")
            time.sleep(0.5)
        self._status(follower)
        time.sleep(1.0)  # a few hundred steps into the run
        t_kill = time.time()
        run("docker", "kill", follower)
        code = self.wait_exit(head, 60)
        hl = self.logs(head)
        self.dc("--profile", "cpu", "down", "-v", "--remove-orphans", files=files, timeout=120)
        lost = [ln for ln in hl.splitlines() if "node 1" in ln and ("lost" in ln or "failed" in ln)]
        print(_indent("\n".join(hl.splitlines()[-12:])), flush=True)
        if code == 0:
            raise CheckFailed("run 2: the head exited 0 after its follower was killed")
        if not lost:
            raise CheckFailed(f"run 2: the head's log does not name node 1 as lost:\n{_indent(hl)}")
        after = _stamp(lost[0]) - t_kill
        if after > HEARTBEAT_TIMEOUT_S + 0.5:
            raise CheckFailed(
                f"run 2: the head noticed the loss {after:.2f}s after the kill (heartbeat timeout "
                f"{HEARTBEAT_TIMEOUT_S}s)"
            )
        say(
            f"run 2 passed: the head named node 1 lost {after:.2f}s after `docker kill` (heartbeat timeout "
            f"{HEARTBEAT_TIMEOUT_S:.0f}s) and exited {code}"
        )

    @staticmethod
    def _status(cid: str) -> dict:
        """`rayfree status --json` inside a node's container (its environment and the compose secret)."""
        import json

        r = run("docker", "exec", cid, "rayfree", "status", "--json", "--timeout", "10", check=False, timeout=60)
        if r.returncode != 0:
            raise CheckFailed(
                f"run 2: `rayfree status` in the follower's container exited {r.returncode}: {r.stderr.strip()}"
            )
        st = json.loads(r.stdout)
        workers = sorted((n["node"], w["rank"]) for n in st["nodes"] for w in n["workers"])
        if [n["node"] for n in st["nodes"]] != [0, 1] or workers != [(0, 0), (0, 1), (1, 2), (1, 3)]:
            raise CheckFailed(f"run 2: `rayfree status` does not show both nodes and all four ranks: {r.stdout}")
        say(
            "run 2: `rayfree status` in the follower's container shows "
            + "; ".join(
                f"node {n['node']} {n['ip']} {n['state']} ranks {n['ranks']} pids {[w['pid'] for w in n['workers']]}"
                for n in st["nodes"]
            )
        )
        return st

    @staticmethod
    def _exited(cid: str) -> bool:
        r = run("docker", "inspect", "-f", "{{.State.Running}}", cid, check=False)
        return r.stdout.strip() == "false"

    def cleanup(self) -> None:
        for files in ([], [self.tmp / "long-run.yml"]):
            if all(f.exists() for f in files):
                self.dc("--profile", "cpu", "down", "-v", "--remove-orphans", files=files, timeout=120, check=False)
        for image in reversed(self.images):
            run("docker", "rmi", "-f", image, check=False, timeout=120)
        shutil.rmtree(self.tmp, ignore_errors=True)
        left = run("docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={TAG}", check=False)
        nets = run("docker", "network", "ls", "-q", "--filter", f"label=com.docker.compose.project={TAG}", check=False)
        if left.stdout.strip() or nets.stdout.strip():
            raise CheckFailed(f"left behind: containers {left.stdout.split()} networks {nets.stdout.split()}")
        say(f"removed the containers, network and image(s) {self.images} this check made")


def _indent(text: str) -> str:
    return "\n".join("    | " + ln for ln in text.splitlines())


def _stamp(line: str) -> float:
    """The time of a `docker logs -t` line (RFC 3339, nanoseconds) as a Unix time."""
    from datetime import datetime, timezone

    ts = line.split(" ", 1)[0]
    head, _, frac = ts.rstrip("Z").partition(".")
    return datetime.strptime(head, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp() + float(
        "0." + (frac or "0")
    )


def main() -> int:
    docker = Docker()
    check = None
    ok = False
    try:
        docker.ensure()
        check = Check()
        check.images_made()
        check.run_clean()
        check.run_killed()
        ok = True
    except CheckFailed as e:
        say(f"FAILED: {e}")
    finally:
        try:
            if check is not None:
                check.cleanup()
        except CheckFailed as e:
            say(f"FAILED: {e}")
            ok = False
        docker.close()
    say(("passed" if ok else "failed") + f" in {time.monotonic() - T0:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
