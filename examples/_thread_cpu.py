"""Where a process's CPU time goes, by thread, and how late its event loop runs: for the benchmarks'
pipeline rows (Linux only; elsewhere both report nothing).

``ThreadCpu`` reads every thread's user + system time from ``/proc/self/task`` and names it: a Python
thread by its ``threading`` name, any other (obstore's tokio workers, nvImageCodec's and CUDA's
threads) by its kernel name; names that differ only in a trailing number are one group, so "four
lanes" is one line. ``ThreadCpu.kernel`` is the same split of the time spent in the kernel (system
time: page faults, futex waits that spin, memory mapping), and ``ThreadCpu.counters`` the process's
context switches and page faults a second (``getrusage``): a decoder pool that costs more host time
than its compute explains shows there. ``LoopLag`` is a coroutine sleeping 1 ms at a time on the
loop being measured: how much longer each sleep took is how long callbacks waited for the loop (and
the loop for the GIL).
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time

try:
    import resource  # Unix: the process's switches and faults
except ImportError:
    resource = None

__all__ = ["LoopLag", "ThreadCpu"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_NUMBERED = re.compile(r"[-_:]?\d+$")


def _group(name: str) -> str:
    # "headrace-lane-3", "ThreadPoolExecutor-0_2", "tokio-runtime-w": the kind of thread, not which one.
    while True:
        shorter = _NUMBERED.sub("", name)
        if shorter == name:
            return name
        name = shorter


def _task_seconds() -> dict[int, tuple[str, float, float]]:
    """{tid: (kernel name, CPU seconds, of which in the kernel)} of this process's threads now."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        user, system = int(fields[11]), int(fields[12])
        out[int(tid)] = (name, (user + system) / _TICK, system / _TICK)
    return out


def _usage() -> dict[str, float]:
    """The process's counters so far, named as ``ThreadCpu.counters`` names their rates (none without ``resource``)."""
    if resource is None:
        return {}
    u = resource.getrusage(resource.RUSAGE_SELF)
    return {"kernel_cores": u.ru_stime, "switches_per_s": u.ru_nvcsw, "involuntary_switches_per_s": u.ru_nivcsw,
            "minor_faults_per_s": u.ru_minflt, "major_faults_per_s": u.ru_majflt}


class ThreadCpu:
    """CPU seconds by kind of thread between ``start()`` and ``stop()``. Threads started meanwhile
    count from zero; threads that ended meanwhile (a shard's parser, say) are one line,
    ``"(ended)"``: the process's CPU time less what the living threads used."""

    def __init__(self) -> None:
        self._before: dict[int, tuple[str, float, float]] = {}
        self._began = 0.0
        self._process = 0.0
        self._usage: dict[str, float] = {}
        self.kernel: dict[str, float] = {}  # after stop(): {kind of thread: system seconds per wall second}
        self.counters: dict[str, float] = {}  # after stop(): the process's _usage() per wall second

    def start(self) -> None:
        self._before = _task_seconds()
        self._began = time.perf_counter()
        self._process = time.process_time()
        self._usage = _usage()

    def stop(self) -> dict[str, float]:
        """{kind of thread: CPU seconds per wall second}, largest first, plus ``"(all)"``."""
        wall = max(time.perf_counter() - self._began, 1e-9)
        python = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
        used: dict[str, float] = {}
        kernel: dict[str, float] = {}
        for tid, (comm, seconds, system) in _task_seconds().items():
            name = _group(python.get(tid, comm))
            _, seconds_before, system_before = self._before.get(tid, (comm, 0.0, 0.0))
            used[name] = used.get(name, 0.0) + seconds - seconds_before
            kernel[name] = kernel.get(name, 0.0) + system - system_before
        process = time.process_time() - self._process
        self.counters = {key: round((after - self._usage[key]) / wall, 3) for key, after in _usage().items()}
        self.kernel = {name: round(s / wall, 3) for name, s in sorted(kernel.items(), key=lambda kv: -kv[1]) if s > 0}
        if used:  # else no /proc: nothing to say by thread
            used["(ended)"] = max(0.0, process - sum(used.values()))
        ranked = {name: round(s / wall, 3) for name, s in sorted(used.items(), key=lambda kv: -kv[1]) if s > 0}
        return {"(all)": round(process / wall, 3), **ranked}


class LoopLag:
    """A sleeper on the running loop: ``start()`` inside the loop, ``stop()`` for the lag in ms (mean, p90, max)."""

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._sleep(), name="benchmark:loop-lag")

    async def _sleep(self) -> None:
        while True:
            began = time.perf_counter()
            await asyncio.sleep(self.period)
            self.lags.append(time.perf_counter() - began - self.period)

    async def stop(self) -> dict[str, float]:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        lags = sorted(self.lags)
        self.lags = []
        if not lags:
            return {}
        return {"mean_ms": round(1e3 * sum(lags) / len(lags), 3), "p90_ms": round(1e3 * lags[int(0.9 * len(lags))], 3),
                "max_ms": round(1e3 * lags[-1], 3)}
