"""DockerSandbox: one long-lived container per attempt, driven through the docker SDK.

Invariants:
- One container per sandbox, named `corral-<attempt id>` and labelled `corral.attempt`; `reset`
  replaces any container of that name, `cleanup` removes it (a missing container is not an error).
- In a process that owns its sandboxes (leftovers.py), containers also carry `corral.owner`, and the
  first use of the daemon removes the containers of dead owners on this host.
- A sandbox of a run on Celery lanes (`run` set) labels its container `corral.run` (the run's id) and
  `corral.incarnation` (the incarnation its id ends with): a lane host's sweep finds a run's containers
  by that label alone, so it never lists another run's (workers.sandboxes).
- Containers run with `network_mode="none"`, `pids_limit`, `mem_limit` and an init process (so
  killed commands' children are reaped); `cpuset_cpus` is the CPU set of the lane running the
  current operation (set at creation, updated when a later operation comes from another lane).
- exec has no timeout in the docker API, so every command runs under a small sh wrapper inside the
  container: the command gets its own session, and when the deadline passes the whole session is
  SIGKILLed (grandchildren included) and the wrapper exits 124 with a marker; that gives
  `timed_out=True, exit_code=None`.
- Output is streamed and capped like LocalSandbox's (`output_limit`, visible notice, `truncated`).
- Every blocking SDK call runs in `asyncio.to_thread`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import logging
import os
import re
import socket
import tarfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import docker
import docker.errors
import docker.utils.socket
import requests.exceptions

from app.cpulist import format_cpu_list
from app.lanes.ops import incarnation_of
from app.sandboxes import leftovers
from app.sandboxes.base import ExecResult
from app.sandboxes.commands import CommandSandbox
from app.sandboxes.local import DEFAULT_OUTPUT_LIMIT, SandboxError, _CappedBuffer, _safe_name

if TYPE_CHECKING:
    from app.tasks.spec import TaskSpec

log = logging.getLogger(__name__)
T = TypeVar("T")

LABEL = "corral.attempt"
RUN_LABEL = "corral.run"
INCARNATION_LABEL = "corral.incarnation"
# $0 = command, $1 = timeout in seconds. The watcher is a separate sh so that killing it (trap)
# also stops its sleep; the marker file distinguishes a deadline kill from a command dying of SIGKILL.
_WATCHER = (
    'sleep "$1" & s=$!; trap "kill \\$s 2>/dev/null; exit 0" TERM; wait $s; '
    'touch /tmp/.corral-timeout-$2; kill -KILL -"$2" 2>/dev/null'
)
_WRAPPER = f"""
setsid sh -c "$0" </dev/null & p=$!
sh -c '{_WATCHER}' _ "$1" "$p" & w=$!
{{ wait $p; rc=$?; kill -TERM $w; wait $w; }} 2>/dev/null
if [ -e /tmp/.corral-timeout-$p ]; then rm -f /tmp/.corral-timeout-$p; exit 124; fi
exit $rc
"""
TIMEOUT_EXIT = 124
SIGKILL_EXIT = 137
# A command that could not fork, or whose exec the runtime could not start (at the pids limit exactly).
_FORK_FAILED = re.compile(r"can't fork|Resource temporarily unavailable|OCI runtime exec failed")
PIDS_MARGIN = 4  # processes an exec needs of its own (the wrapper's shells and its watcher's sleep)
DEATH_CHECKS, DEATH_CHECK_S = 5, 0.1  # how long a SIGKILLed command's container may take to show exited
DAEMON_WAIT_S = 60.0  # how long an op waits for a daemon that cannot be reached (a restart) to come back
DAEMON_POLL_S = 0.5
DEFAULT_SOCKET = "unix:///var/run/docker.sock"  # the SDK's daemon when none is named
CALL_TIMEOUT_S = 60  # one SDK call (the SDK's default); an exec's output socket waits as long as it runs


class DaemonAway(SandboxError):
    """The daemon could not be reached (connection refused, socket gone): it may come back."""


class DockerSandboxFactory:
    isolation = "docker"

    def __init__(
        self,
        image: str,
        *,
        client: docker.DockerClient | None = None,
        base_url: str | None = None,
        work_dir: str = "/work",
        mem_limit: str | int = "4g",
        pids_limit: int = 512,
        output_limit: int = DEFAULT_OUTPUT_LIMIT,
        keep_alive_cmd: Sequence[str] = ("sleep", "2147483647"),
        daemon_wait_s: float = DAEMON_WAIT_S,
    ) -> None:
        if output_limit <= 0:
            raise SandboxError(f"output_limit must be positive, got {output_limit}")
        self.image = image
        self._client = client
        self._base_url = base_url
        self.work_dir = work_dir
        self.mem_limit = mem_limit
        self.pids_limit = pids_limit
        self.output_limit = output_limit
        self.keep_alive_cmd = list(keep_alive_cmd)
        self.daemon_wait_s = daemon_wait_s
        self._away_lock = threading.Lock()
        self._away_since: float | None = None
        self._stopping = False
        self.owner_label = leftovers.container_owner_label()  # empty unless this process owns them
        self.run: str | None = None  # the run its sandboxes belong to, on Celery lanes (`RUN_LABEL`)

    @property
    def client(self) -> docker.DockerClient:
        # Built lazily: creating a client talks to the daemon, which must not happen at import or
        # construction time inside the event loop.
        if self._client is None:
            self._client = self._connect(CALL_TIMEOUT_S)
            if self.owner_label:
                self.remove_leftovers()
        return self._client

    @property
    def _address(self) -> str | None:
        """The daemon's address as given (the factory's, else `DOCKER_HOST`); None: the SDK's default."""
        return self._base_url or os.environ.get("DOCKER_HOST")

    @property
    def daemon(self) -> str:
        """Where the daemon is looked for, as the user would name it."""
        return self._address or f"{DEFAULT_SOCKET} (default)"

    def check(self, timeout_s: float = 10.0) -> None:
        """Before any work: a `SandboxError` of one line when no daemon answers within `timeout_s` or
        it lacks the image. A declared owner's first use of the daemon also removes dead owners'
        containers (leftovers.py)."""
        if self._client is None:
            try:
                client = self._connect(timeout_s)
            except docker.errors.DockerException as exc:
                raise SandboxError(f"no docker daemon answers at {self.daemon}: {_reason(exc)}") from None
            client.api.timeout = CALL_TIMEOUT_S  # the short wait was for the first answer only
            self._client = client
            if self.owner_label:
                self.remove_leftovers()
        try:
            self.client.images.get(self.image)
        except docker.errors.ImageNotFound:
            raise SandboxError(
                f"docker image {self.image!r} is not on the daemon at {self.daemon}: build or pull it first"
            ) from None
        except docker.errors.DockerException as exc:
            raise SandboxError(f"docker daemon at {self.daemon}: {_reason(exc)}") from None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def stopping(self) -> None:
        """The run is stopping: an op no longer waits for a daemon that went away (a Ctrl-C waited
        `daemon_wait_s` for each round of clean-ups its lane's slots took); the containers left are
        removed by the next start (leftovers.py)."""
        self._stopping = True

    def wait_for_daemon(self) -> bool:
        """Whether the daemon answers a ping again within `daemon_wait_s` of the outage's start (said
        once per outage). Every op of the outage shares that window: once it has passed, or once the run
        is stopping, an op asks once and waits no more."""
        with self._away_lock:
            if self._away_since is None:
                self._away_since = time.monotonic()
                log.warning("docker daemon at %s does not answer: sandbox ops wait for it", self.daemon)
            deadline = self._away_since + self.daemon_wait_s
        while True:
            with contextlib.suppress(docker.errors.DockerException, requests.exceptions.RequestException):
                if self._accepts() and self.client.ping():
                    with self._away_lock:
                        if self._away_since is not None:
                            log.warning(
                                "docker daemon at %s answers again after %.1f s",
                                self.daemon,
                                time.monotonic() - self._away_since,
                            )
                            self._away_since = None
                    return True
            if self._stopping or time.monotonic() >= deadline:
                return False
            time.sleep(DAEMON_POLL_S)

    def _accepts(self) -> bool:
        """Whether a unix-socket daemon takes connections (any other: assumed), probed with a plain socket:
        the SDK leaks the socket of every connection that fails."""
        where = self._address or DEFAULT_SOCKET
        if not where.startswith("unix://"):
            return True
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(where.removeprefix("unix://"))
            except OSError:
                return False
        return True

    def _connect(self, timeout_s: float) -> docker.DockerClient:
        if self._base_url:
            return docker.DockerClient(base_url=self._base_url, timeout=timeout_s)
        return docker.from_env(timeout=timeout_s)

    def remove_leftovers(self) -> int:
        """Remove the containers that dead corral processes of this host left (leftovers.py). Two corral
        processes starting at once both sweep (`_labelled`, `_remove_container`). A sweep that fails
        otherwise is logged, and the start goes on (leftovers.py's rule); the next start sweeps again."""
        try:
            return leftovers.sweep_containers(
                lambda label: [
                    (container, labels.get(label, "")) for container, labels in self._labelled(label)
                ],
                self._remove_container,
            )
        except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
            log.warning("could not remove what dead corral processes left on the docker daemon at %s (%s); "
                        "going on, the next start tries again", self.daemon, _reason(exc))  # fmt: skip
            return 0

    def remove_run_containers(self, run: str, dead: Callable[[str], bool]) -> list[str]:
        """Remove the containers of run `run` (listed by its label alone: never another run's) whose
        attempt id `dead` takes (a sweep on a lane host: workers.sandboxes); returns those attempt ids. A
        daemon that fails is a `SandboxError` of one line."""
        removed = []
        try:
            for container, labels in self._labelled(f"{RUN_LABEL}={run}"):
                attempt = labels.get(LABEL, "")
                if labels.get(RUN_LABEL) == run and dead(attempt):
                    self._remove_container(container)
                    removed.append(attempt)
        except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
            raise SandboxError(f"docker daemon at {self.daemon}: {_reason(exc)}") from None
        return removed

    def _labelled(self, label: str) -> list[tuple[str, dict[str, str]]]:
        """The containers carrying `label` (`key` or `key=value`), stopped ones too, as (id, labels). Listed
        in one call: `containers.list` inspects each container after listing it, and failed with NotFound
        on one that a live corral process removed meanwhile."""
        listed = self.client.api.containers(all=True, filters={"label": label})
        return [(c["Id"], c.get("Labels") or {}) for c in listed]

    def _remove_container(self, container: str) -> bool:
        """Remove `container`, running or not; whether this call removed it. One another sweep is
        removing (409, "removal ... already in progress") or has removed (404) is no error, and that
        sweep's to count."""
        try:
            self.client.api.remove_container(container, force=True)
        except docker.errors.APIError as exc:
            if exc.status_code not in (404, 409):  # gone, or going
                raise
            return False
        return True

    def create(self, attempt_id: str) -> DockerSandbox:
        return DockerSandbox(self, attempt_id)


class DockerSandbox(CommandSandbox):
    def __init__(self, factory: DockerSandboxFactory, attempt_id: str) -> None:
        self.factory = factory
        self.attempt_id = attempt_id
        self.container_name = f"corral-{_safe_name(attempt_id)}"
        self.container_id: str | None = None
        self.run = factory.run  # on a lane worker: the run its handle names
        self._cpus: str | None = None
        self._task: TaskSpec | None = None
        # Creation and removal run in threads, which a cancelled await leaves running: a reset
        # cancelled mid-creation (the run stopping) must not create its container after the cleanup
        # that followed it has removed nothing. Each removal starts a new generation under the lock; a
        # creation of an older generation gives up.
        self._lock = threading.Lock()
        self._generation = 0

    isolation = "docker"

    # -- the port -----------------------------------------------------------------------------------

    async def reset(self, task: TaskSpec, cpus: Sequence[int] | None = None) -> ExecResult:
        archive = await asyncio.to_thread(_task_archive, task)
        await asyncio.to_thread(self._remove)
        await asyncio.to_thread(self._start, cpus, archive, self._generation)
        return await self._set_up(task, cpus)

    async def cleanup(self, cpus: Sequence[int] | None = None) -> None:
        await asyncio.to_thread(self._remove)
        self._task = None

    def adopt(self, task: TaskSpec | None, container_id: str | None) -> None:
        """Take over this sandbox as `reset` left it in another process of this host (a Celery pool
        process): its task and its container. The container's CPU set is re-applied by the next op."""
        self._task = task
        self.container_id = container_id
        self._cpus = None

    # -- internals (blocking; called through to_thread) ---------------------------------------------

    def _require_reset(self) -> TaskSpec:
        if self._task is None or self.container_id is None:
            raise SandboxError(f"sandbox {self.attempt_id!r} used before reset (or after cleanup)")
        return self._task

    def _start(self, cpus: Sequence[int] | None, archive: bytes, generation: int) -> None:
        with self._lock:
            if generation != self._generation:
                raise SandboxError(f"sandbox {self.attempt_id!r} was cleaned up while its reset started")

            def start_afresh() -> None:
                # Again from scratch after the daemon went away: it may have made the container.
                self._remove_locked()
                self._start_locked(cpus, archive)

            self._while_daemon_away("starting", start_afresh)

    def _start_locked(self, cpus: Sequence[int] | None, archive: bytes) -> None:
        f = self.factory
        kwargs: dict[str, Any] = {}
        if cpus:
            kwargs["cpuset_cpus"] = format_cpu_list(cpus)
        container = f.client.containers.run(
            f.image,
            f.keep_alive_cmd,
            name=self.container_name,
            detach=True,
            init=True,
            network_mode="none",
            pids_limit=f.pids_limit,
            mem_limit=f.mem_limit,
            working_dir=f.work_dir,
            labels={LABEL: self.attempt_id, **f.owner_label, **self._run_labels()},
            **kwargs,
        )
        self.container_id = container.id
        self._cpus = kwargs.get("cpuset_cpus")
        # The image may lack the work dir; put_archive needs it to exist.
        mkdir = f.client.api.exec_create(container.id, ["mkdir", "-p", f.work_dir])["Id"]
        f.client.api.exec_start(mkdir)
        if not container.put_archive(f.work_dir, archive):
            raise SandboxError(f"copying the task files into {self.container_name}:{f.work_dir} failed")

    def _run_labels(self) -> dict[str, str]:
        incarnation = incarnation_of(self.attempt_id)
        if self.run is None or incarnation is None:
            return {}
        return {RUN_LABEL: self.run, INCARNATION_LABEL: str(incarnation)}

    def _remove(self) -> None:
        with self._lock:
            self._generation += 1
            self._while_daemon_away("removing", self._remove_locked)

    def _remove_locked(self) -> None:
        try:
            container = self.factory.client.containers.get(self.container_name)
        except docker.errors.NotFound:
            self.container_id = None
            return
        with contextlib.suppress(docker.errors.NotFound):
            container.remove(force=True)
        self.container_id = None
        self._cpus = None

    def _set_cpus(self, cpus: Sequence[int] | None) -> None:
        if not cpus:
            return
        wanted = format_cpu_list(cpus)
        if wanted != self._cpus:
            assert self.container_id is not None
            self.factory.client.api.update_container(self.container_id, cpuset_cpus=wanted)
            self._cpus = wanted

    def _while_daemon_away(self, doing: str, op: Callable[[], T]) -> T:
        """`op`, again once the daemon answers when it could not be reached (a restart), within the
        outage's `daemon_wait_s` (`DockerSandboxFactory.wait_for_daemon`); then the `DaemonAway` stands."""
        while True:
            try:
                with self._docker_errors(doing):
                    return op()
            except DaemonAway:
                if not self.factory.wait_for_daemon():
                    raise

    @contextlib.contextmanager
    def _docker_errors(self, doing: str) -> Iterator[None]:
        """An SDK failure as a `SandboxError` of one line that says what failed: the daemon, or this
        sandbox's container (killed, stopped or removed behind corral's back)."""
        try:
            yield
        except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
            problem = self._container_problem() if isinstance(exc, docker.errors.APIError) else None
            away = isinstance(exc, requests.exceptions.ConnectionError)
            if problem is None:
                problem = f"docker daemon at {self.factory.daemon}: {_reason(exc)}"
        else:
            return
        # Raised outside the handler: the SDK's exception, whose frames hold the socket of a failed
        # connection, is not kept alive as this one's context.
        kind = DaemonAway if away else SandboxError
        raise kind(f"{doing} {self.container_name}: {problem}")

    def _container_problem(self) -> str | None:
        """Why this sandbox's container cannot run commands, or None when it is running."""
        try:
            api = self.factory.client.api
            state = api.inspect_container(self.container_id or self.container_name)["State"]
        except docker.errors.NotFound:
            return "the container is gone (removed outside corral)"
        except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
            return f"docker daemon at {self.factory.daemon}: {_reason(exc)}"
        if state.get("Running"):
            return None
        oom = f", out of memory (mem_limit {self.factory.mem_limit})" if state.get("OOMKilled") else ""
        status = state.get("Status", "not running")
        return (
            f"the container is {status} (exit code {state.get('ExitCode')}{oom}): "
            "killed or stopped outside corral, or its daemon restarted"
        )

    def _exec_blocking(self, command: str, timeout_s: float, cpus: Sequence[int] | None) -> ExecResult:
        with self._docker_errors("running a command in"):
            result = self._exec_unchecked(command, timeout_s, cpus)
        if not result.timed_out and (result.exit_code is None or result.exit_code >= 128):
            # A container that died under the command ends it as a SIGKILL would: say what happened. The
            # daemon may mark the container exited a moment after the command's end; a command that
            # killed itself costs that wait.
            problem = self._container_problem()
            for _ in range(DEATH_CHECKS if result.exit_code in (None, SIGKILL_EXIT) else 0):
                if problem is not None:
                    break
                time.sleep(DEATH_CHECK_S)
                problem = self._container_problem()
            if problem is not None:
                raise SandboxError(f"running a command in {self.container_name}: {problem}")
        if result.exit_code and _FORK_FAILED.search(result.output):
            note = self._process_limit_note()
            if note:
                return dataclasses.replace(result, output=f"{result.output}{note}\n")
        return result

    def _process_limit_note(self) -> str | None:
        """What to tell a command that could not fork, or whose exec could not start, when the sandbox is
        at its `pids_limit`: processes earlier commands left in the background hold it (they run until
        they end or the sandbox is reset). None when the container is not near its limit."""
        try:
            pids = self.factory.client.api.stats(self.container_id, stream=False, one_shot=True)["pids_stats"]
            current, limit = int(pids["current"]), int(pids["limit"])
        except (docker.errors.DockerException, requests.exceptions.RequestException, KeyError, TypeError):
            return None
        if current + PIDS_MARGIN < limit:
            return None
        return (
            f"[corral] this sandbox is at its process limit ({limit} processes, {current} running): "
            "processes that earlier commands left running hold it until they end or the sandbox is reset"
        )

    def _create_exec(self, command: str, timeout_s: float, cpus: Sequence[int] | None) -> str:
        self._set_cpus(cpus)
        assert self.container_id is not None
        return str(
            self.factory.client.api.exec_create(
                self.container_id,
                ["sh", "-c", _WRAPPER, command, f"{max(timeout_s, 0.001):.3f}"],
                workdir=self.factory.work_dir,
            )["Id"]
        )

    def _exec_unchecked(self, command: str, timeout_s: float, cpus: Sequence[int] | None) -> ExecResult:
        started = time.monotonic()
        api = self.factory.client.api
        # Until the command starts, an op can wait for a daemon that went away and try again; once it
        # runs, what it did is unknown, so a daemon lost then fails it.
        exec_id = self._while_daemon_away(
            "running a command in", lambda: self._create_exec(command, timeout_s, cpus)
        )
        buffer = _CappedBuffer(self.factory.output_limit)
        # The raw socket rather than stream=True: the SDK's stream leaves its socket open.
        sock = api.exec_start(exec_id, socket=True)
        try:
            for _stream, chunk in docker.utils.socket.frames_iter(sock, tty=False):
                buffer.feed(chunk)
        finally:
            # SocketIO.close() leaves the underlying socket open; close that too.
            raw = getattr(sock, "_sock", None)
            sock.close()
            if raw is not None:
                raw.close()
        exit_code = api.exec_inspect(exec_id)["ExitCode"]
        timed_out = exit_code == TIMEOUT_EXIT and time.monotonic() - started >= timeout_s
        return ExecResult(
            exit_code=None if timed_out else exit_code,
            output=buffer.text(),
            timed_out=timed_out,
            truncated=buffer.dropped > 0,
            duration_s=time.monotonic() - started,
        )

    async def _run(
        self, command: str, timeout_s: float, cpus: Sequence[int] | None, lane: str = "exec"
    ) -> ExecResult:
        return await asyncio.to_thread(self._exec_blocking, command, timeout_s, cpus)


def _task_archive(task: TaskSpec) -> bytes:
    """The task's files as a tar stream, paths relative to the work dir."""
    root = task.root.resolve()
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        for rel in task.files:
            src = (root / rel).resolve()
            if not src.is_relative_to(root):
                raise SandboxError(f"task {task.name!r}: file {rel!r} is outside the task root {root}")
            if not src.exists():
                raise SandboxError(f"task {task.name!r}: file {rel!r} not found under {root}")
            tar.add(src, arcname=str(Path(rel)), recursive=True)
    return data.getvalue()


def _reason(exc: BaseException) -> str:
    """The innermost cause of an SDK error, on one line (the SDK nests requests' and urllib3's)."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]
