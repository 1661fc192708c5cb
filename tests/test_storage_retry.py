"""storage_retry_seconds: a gs:// storage that fails or stops answering mid-run is retried that long,
then the run stops with one `error:` line naming the bucket, exit code 3, and really exits; the
rerun after the storage is back resumes. Unit tests of the watched call, then whole runs (slow)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from MaxText.paths import storage, storage_retry
from MaxText.paths.storage_retry import StorageUnavailable
from tests.conftest import REPO_ROOT


@pytest.fixture
def budget(monkeypatch):
  """A fresh retry state with a short budget; the bucket answers unless a test says otherwise."""
  state = storage_retry._State(budget=1.0)
  monkeypatch.setattr(storage_retry, "_state", state)
  probe = {"error": None}
  monkeypatch.setattr(storage_retry, "_probe", lambda bucket, timeout: probe["error"])
  return probe


def test_transient_failures_are_retried_until_the_operation_succeeds(budget):
  calls = []

  def flaky() -> int:
    calls.append(time.monotonic())
    if len(calls) < 3:
      raise ConnectionRefusedError(111, "Connection refused")
    return 7

  storage_retry._state.budget = 10.0
  assert storage_retry.call("writing x", "gs://bkt/x", flaky) == 7
  assert len(calls) == 3 and not storage_retry.is_down()


def test_failing_for_the_budget_gives_up_with_one_line_naming_the_bucket_then_every_call_fails_at_once(budget):
  def refused() -> None:
    raise ConnectionRefusedError(111, "Connection refused")

  storage_retry.note_saved("gs://bkt/runs/x/checkpoints", 4)
  started = time.monotonic()
  with pytest.raises(StorageUnavailable) as caught:
    storage_retry.call("writing runs/x/metrics.jsonl", "gs://bkt/runs/x/metrics.jsonl", refused)
  assert time.monotonic() - started < 1.0 + 2.0
  message = str(caught.value)
  assert message.startswith("gs://bkt: writing runs/x/metrics.jsonl failed for 1 s (connection refused); "), message
  assert "storage_retry_seconds=1" in message and "rerun the same command once it is back" in message
  assert message.endswith("checkpoint steps up to 4 are saved in gs://bkt/runs/x/checkpoints")
  assert "\n" not in message and caught.value.exit_code == 3

  started = time.monotonic()  # nothing is tried any more: no second wait for the same outage
  for attempt in (lambda: storage.read_text("gs://bkt/runs/x/config.yml"), lambda: storage.as_path("gs://other/y")):
    with pytest.raises(StorageUnavailable):
      attempt()
  assert time.monotonic() - started < 0.5


def test_giving_up_inside_one_request_fails_that_call_only(budget):
  """A server reading a path one request names (a LoRA adapter's): a dead bucket fails that read with one line,
  and later storage calls of the process still run. Before, the server gave up on all gs:// storage for good."""
  def refused() -> None:
    raise ConnectionRefusedError(111, "Connection refused")

  with storage_retry.one_request(), pytest.raises(StorageUnavailable) as caught:
    storage_retry.call("checking adapters/a/adapter_config.json", "gs://dead/adapters/a/adapter_config.json", refused)
  assert str(caught.value).startswith("gs://dead: checking adapters/a/adapter_config.json failed for 1 s "
                                      "(connection refused)") and str(caught.value).endswith("try again once it is back")
  assert not storage_retry.is_down()
  assert storage_retry.call("reading b", "gs://live/b", lambda: "read") == "read"


def test_a_hung_operation_on_a_silent_bucket_gives_up_within_the_budget(budget):
  budget["error"] = TimeoutError("no answer within 1 s")
  release = threading.Event()
  started = time.monotonic()
  with pytest.raises(StorageUnavailable, match=r"^gs://bkt: saving checkpoint step 8 failed for 1 s \(no answer\)"):
    storage_retry.call("saving checkpoint step 8", "gs://bkt/c", release.wait, retry=False)
  assert time.monotonic() - started < 1.0 + 2.0
  release.set()


def test_a_slow_operation_on_a_live_bucket_is_not_cut_short(budget):
  storage_retry._state.budget = 0.5
  assert storage_retry.call("writing big", "gs://bkt/big", lambda: time.sleep(2.0) or "done") == "done"
  assert not storage_retry.is_down()


def test_errors_retrying_cannot_fix_are_raised_at_once_and_unchanged(budget):
  from gcsfs.retry import HttpError

  calls = []

  def refused_write() -> None:
    calls.append(1)
    raise HttpError({"code": 403, "message": "injected: writes refused"})

  with pytest.raises(HttpError, match="writes refused"):
    storage_retry.call("writing x", "gs://bkt/x", refused_write)
  assert len(calls) == 1 and not storage_retry.is_down()


def test_local_paths_are_not_watched(budget):
  assert storage_retry.call("writing", "/tmp/x", threading.get_ident) == threading.get_ident()


def test_what_counts_as_transient_and_how_the_line_names_it():
  import requests
  from gcsfs.retry import HttpError
  from google.api_core import exceptions

  assert storage_retry.is_transient(ValueError("ABORTED: All 3 retry attempts failed: CURL error Could not connect"))
  assert storage_retry.is_transient(HttpError({"code": 503, "message": "unavailable"}))
  assert storage_retry.is_transient(ConnectionResetError())
  assert not storage_retry.is_transient(HttpError({"code": 403, "message": "forbidden"}))
  assert not storage_retry.is_transient(FileNotFoundError("gs://b/x"))
  assert not storage_retry.is_transient(ValueError("DATA_LOSS: Error reading ocdbt manifest"))
  reset = requests.ConnectionError(("Connection aborted.", ConnectionResetError(104, "Connection reset by peer")))
  assert storage_retry.is_transient(reset) and storage_retry.reason(reset) == "connection reset"
  assert storage_retry.reason(ValueError("ABORTED: All 9 retry attempts failed: CURL error Could not connect to server")) \
      == "connection refused"
  assert storage_retry.reason(exceptions.ServiceUnavailable("503 GET http://x/b: injected")) == "HTTP 503"
  assert storage_retry.reason(TimeoutError("no answer within 2 s")) == "no answer"


@pytest.fixture
def library_settings(monkeypatch):
  """configure() changes process-wide library settings: put them back after the test."""
  from gcsfs import core
  from orbax.checkpoint._src.serialization import tensorstore_utils

  for name in ("_request", "_get_file_request", "_get_file_concurrent"):  # on the class that defines them
    monkeypatch.setattr(core.GCSFileSystem, name, core.GCSFileSystem.__dict__[name])
  for context in (tensorstore_utils._BASE_TS_CONTEXT, tensorstore_utils._DEFAULT_OCDBT_TS_CONTEXT):
    monkeypatch.setitem(context, "gcs_request_retries", context.get("gcs_request_retries", {}))
  monkeypatch.setattr(storage_retry, "_state", storage_retry._State())


def test_tensorstore_keeps_retrying_for_the_budget_and_orbax_uses_it(library_settings):
  from orbax.checkpoint._src.serialization import tensorstore_utils

  for seconds in (10.0, 300.0):
    retries = storage_retry.tensorstore_retries(seconds)
    initial, maximum = float(retries["initial_delay"][:-1]), float(retries["max_delay"][:-1])
    delays = [min(initial * 2 ** i, maximum) for i in range(retries["max_retries"])]
    assert seconds <= sum(delays) < seconds + maximum + initial and maximum <= 32
  storage_retry.configure(10)
  spec = tensorstore_utils.get_ts_context(use_ocdbt=True).spec.to_json()
  wanted = storage_retry.tensorstore_retries(10)
  assert spec["gcs_request_retries"]["max_retries"] == wanted["max_retries"]
  assert spec["gcs_request_retries"]["max_delay"] == wanted["max_delay"]


def test_a_budget_of_days_or_never_is_counted_at_once(library_settings):
  """A day (86400) overflowed 2.0 ** attempts in gcsfs's count at every start-up, and 10**13 made both
  counts loop for hours; each is now the capped delay's share of the rest, the same count as the loop's."""
  for seconds in (0.5, 10.0, 300.0, 3600.0, 86400.0, 1e6, 1e13):
    retries = storage_retry.tensorstore_retries(seconds)
    initial, maximum = float(retries["initial_delay"][:-1]), float(retries["max_delay"][:-1])
    doublings = next(i for i in range(64) if initial * 2 ** i >= maximum)  # delays before the cap
    capped = retries["max_retries"] - doublings
    total = sum(initial * 2 ** i for i in range(doublings)) + capped * maximum
    assert seconds <= total < seconds + maximum
    attempts = storage_retry.gcsfs_retries(seconds)
    waits = sum(2.0 ** i for i in range(min(attempts - 1, 6))) + max(0, attempts - 7) * 32.0
    assert attempts == 6 or seconds <= waits < seconds + 32
  storage_retry.configure(86400)
  storage_retry.configure(10**13)


def test_gcsfs_keeps_retrying_for_the_budget(library_settings, monkeypatch):
  """gcsfs fixes its retry count when its class is defined; configure() sets it from the budget."""
  import logging

  import gcsfs
  import gcsfs.retry

  retried = []
  is_retriable = gcsfs.retry.is_retriable

  async def no_wait(seconds: float) -> None:
    pass

  monkeypatch.setattr(gcsfs.retry.asyncio, "sleep", no_wait)
  monkeypatch.setattr(gcsfs.retry, "is_retriable", lambda e: retried.append(e) or is_retriable(e))  # each but the last
  monkeypatch.setattr(logging.getLogger("gcsfs"), "level", logging.CRITICAL)
  storage_retry.configure(300)
  fs = gcsfs.GCSFileSystem(endpoint_url="http://127.0.0.1:9", token="anon", skip_instance_cache=True)
  with pytest.raises(OSError):  # nothing listens on the discard port
    fs.cat("bucket1/x")
  assert len(retried) + 1 == storage_retry.gcsfs_retries(300) > 6
  assert sum(min(2.0 ** i, 32.0) for i in range(len(retried))) >= 300  # its backoff, less the jitter


def test_the_process_exits_after_the_line_though_a_library_thread_still_hangs():
  """Orbax's save finalizer is a non-daemon thread; blocked on a dead endpoint it would keep
  the interpreter from exiting for ever."""
  script = textwrap.dedent("""
      import threading, time
      from MaxText.errors import run_cli
      from MaxText.paths.storage_retry import StorageUnavailable

      def main(argv):
        threading.Thread(target=time.sleep, args=(600,)).start()  # not a daemon
        raise StorageUnavailable("gs://bkt: saving checkpoint step 8 failed for 10 s (connection refused)")

      run_cli(main)
  """)
  started = time.time()
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
  assert time.time() - started < 60
  assert proc.returncode == 3
  assert proc.stderr.splitlines() == ["error: gs://bkt: saving checkpoint step 8 failed for 10 s (connection refused)"]


# ------------------------------------------------------------------ whole runs on a local GCS server

RETRY_SECONDS = 10
SLACK_SECONDS = 20  # the exit itself and a loaded machine; what matters is that it is bounded


@pytest.mark.slow  # two training runs and a wait of storage_retry_seconds
@pytest.mark.parametrize("fault", ["down", "stall"])
def test_storage_gone_mid_run_stops_with_one_line_within_the_budget_and_the_rerun_resumes(gcs, gcs_bucket, fault):
  """down: the endpoint stops listening (connections refused); stall: it accepts requests and never
  answers. Either way, from the moment it goes: one line within the budget, exit code 3."""
  from tests.chaos.fault_proxy import FaultProxy
  from tests.test_gcs_run import command, env, losses, start_and_signal

  proxy = FaultProxy(gcs.url)
  out = f"{gcs_bucket}/runs"
  run_dir = f"{out}/gone"

  def committed_steps(_: str = "") -> list[int]:  # the server's own listing: no client-side listing cache
    names = [n.split("/") for n in gcs.objects(gcs_bucket[5:], "runs/gone/checkpoints/")]
    return sorted(int(n[3]) for n in names if len(n) == 5 and n[3].isdigit() and n[4] == "commit_success.txt")

  cmd = command(out, "gone", "checkpoint_period=4", "steps=20", "learning_rate_schedule_steps=20",
                f"storage_retry_seconds={RETRY_SECONDS}")
  proc = None
  try:
    proc = start_and_signal(cmd, env(None, **proxy.env()), 5, lambda: 4 in committed_steps(run_dir), None)
    proxy.set_mode(fault, stall_seconds=3600)
    gone = time.time()
    stdout, stderr = proc.communicate(timeout=RETRY_SECONDS + 120)
    took = time.time() - gone

    assert proc.returncode == 3, (proc.returncode, stderr[-3000:])  # TrainingError: not 143, not 0
    assert took < RETRY_SECONDS + SLACK_SECONDS, took
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error")]
    assert len(errors) == 1 and errors[0] == lines[-1], lines
    assert errors[0].startswith(f"error: {gcs_bucket}: ") and "storage is unreachable" in errors[0], errors[0]
    assert f"storage_retry_seconds={RETRY_SECONDS}" in errors[0]
    saved = committed_steps(run_dir)  # the server's view: what a rerun finds
    assert f"checkpoint steps up to {saved[-1]} are saved in {run_dir}/checkpoints" in errors[0] or \
        f"(step {saved[-1]} was being saved)" in errors[0], (saved, errors[0])
    assert "Traceback" not in stderr and len(lines) <= 6, lines
    assert "done:" not in stdout

    proxy.set_mode("pass")  # the storage is back: the same command resumes and finishes
    rerun = subprocess.run(cmd, cwd=REPO_ROOT, env=env(None, **proxy.env()), capture_output=True, text=True,
                           timeout=600)
  finally:
    if proc is not None and proc.poll() is None:  # a run that did not stop must not outlive the test
      proc.kill()
    proxy.close()
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert f"state: resumed from step {saved[-1]} of {run_dir}/checkpoints" in rerun.stdout, (saved, rerun.stdout[:3000])
  assert sorted(losses(run_dir)) == list(range(1, 21))
  assert committed_steps(run_dir)[-1] == 20
  assert not [n for n in gcs.objects(gcs_bucket[5:], "runs/gone/checkpoints/") if "corrupt" in n]  # not damaged
  assert proc.returncode != 128 + signal.SIGTERM
