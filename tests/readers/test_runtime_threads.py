"""obstore's runtime as headrace prepares it: at most ``RUNTIME_THREADS`` workers unless the user's
``TOKIO_WORKER_THREADS`` says otherwise, and a script that reads and returns exits cleanly. Each case
runs in a fresh process: tokio reads the variable once, when the runtime starts, and the exit is what
is tested."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from headrace.readers._storage._obstore import RUNTIME_THREADS

from storage_servers import ACCESS_KEY, BUCKET, SECRET_KEY as SECRET

pytest.importorskip("obstore")

# The child claims 16 cores (tokio's own default would then be 16 workers, not the 2 of a CI machine),
# reads one object over S3, and reports the variable and its threads' names.
CHILD = textwrap.dedent("""
    import asyncio, collections, glob, json, os, sys
    os.sched_getaffinity = lambda pid: set(range(16))
    os.cpu_count = lambda: 16
    from headrace.readers._storage import S3Store, HttpStore
    endpoint, access, secret, bucket, http = sys.argv[1:6]
    async def main():
        store = S3Store(bucket, endpoint=endpoint, access_key_id=access, secret_access_key=secret)
        s3 = len(await store.read("wds/headrace-index.json"))
        return s3, len(await HttpStore().read(http + "/wds/headrace-index.json"))
    sizes = asyncio.run(main())
    names = collections.Counter(open(p).read().strip() for p in glob.glob("/proc/self/task/*/comm"))
    print(json.dumps({"sizes": sizes, "env": os.environ.get("TOKIO_WORKER_THREADS"),
                      "tokio": sum(n for name, n in names.items() if name.startswith("tokio"))}))
""")


def _child(servers, env_value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TOKIO_WORKER_THREADS"}
    if env_value is not None:
        env["TOKIO_WORKER_THREADS"] = env_value
    done = subprocess.run([sys.executable, "-c", CHILD, servers.s3_direct, ACCESS_KEY, SECRET, BUCKET,
                           servers.http_direct], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_runtime_is_capped_on_a_many_core_host(servers):
    got = _child(servers, None)
    size = (servers.root / "wds" / "headrace-index.json").stat().st_size
    assert got["sizes"] == [size, size]  # both stores read through the capped runtime
    assert got["env"] == str(RUNTIME_THREADS)
    # The workers, and at most a thread or two of tokio's own beside them; 16 cores uncapped: 17.
    assert RUNTIME_THREADS <= got["tokio"] <= RUNTIME_THREADS + 2


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_the_users_setting_wins(servers):
    got = _child(servers, "7")
    assert got["env"] == "7"
    assert 7 <= got["tokio"] <= 9


def test_a_script_that_reads_and_returns_exits_cleanly(servers):
    # Without the wait at exit, 12 of 120 such processes aborted (SIGABRT) as a runtime thread took
    # the GIL back while Python finalized; 30 runs catch that with a probability of ~0.96.
    for _ in range(30):
        assert _child(servers, None)["env"] == str(RUNTIME_THREADS)
