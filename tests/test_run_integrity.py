"""Run integrity with real training processes, on local disk and on gs:// (a GCS JSON API on
127.0.0.1): a resume with a changed shape stops before touching anything, a second run in a
busy run directory stops naming the first, a dead run's lease is taken over, allowed changes
resume, and the tools after a fine-tune take the model keys from the run they read."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time

import pytest

from MaxText.errors import UserError
from MaxText.run_dir import run_lease
from MaxText.paths import storage
from tests.conftest import REPO_ROOT
from tests.test_gcs_run import committed_steps, command, env, losses, run, start_and_signal

STEPS = 30  # run_name and steps as in the second scenario


def _root(request, tmp_path) -> tuple[str, object]:
  """(base_output_directory, gcs server or None) for the `where` parameter."""
  if request.param == "local":
    return str(tmp_path), None
  return request.getfixturevalue("gcs_bucket") + "/runs", request.getfixturevalue("gcs")


@pytest.fixture(params=["local", pytest.param("gs", marks=pytest.mark.slow)])
def where(request, tmp_path):
  return _root(request, tmp_path)


def _files(root: str) -> dict[str, str]:
  """Every file under `root` (local or gs://) and the SHA-256 of its bytes."""
  found: dict[str, str] = {}

  def walk(directory: str) -> None:
    for name in storage.listdir(directory):
      path = storage.join(directory, name)
      if storage.is_dir(path):
        walk(path)
      else:
        found[path[len(root):]] = hashlib.sha256(storage.read_bytes(path)).hexdigest()

  walk(root)
  return found


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
  lines = [line for line in proc.stderr.splitlines() if line.startswith("error")]
  text = proc.stdout + proc.stderr
  assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
  return lines[0]


@pytest.fixture(scope="module")
def lone_run(tmp_path_factory) -> dict[int, float]:
  out = tmp_path_factory.mktemp("lone")
  run(command(str(out), "dup", f"steps={STEPS}", "checkpoint_period=5", f"learning_rate_schedule_steps={STEPS}"),
      env(None))
  return losses(str(out / "dup"))


def test_a_resume_with_a_changed_shape_exits_2_naming_the_key_and_changes_nothing(where):
  out, gcs = where
  cmd = command(out, "shape", "steps=6", "checkpoint_period=3")
  run(cmd, env(gcs))
  run_dir = storage.join(out, "shape")
  before = _files(run_dir)
  assert {"/checkpoints/3/commit_success.txt", "/checkpoints/6/commit_success.txt", "/config.yml"} <= set(before)

  proc = run(cmd + ["base_emb_dim=32"], env(gcs), expect=2)
  line = _one_error_line(proc)
  assert "base_emb_dim: 64 -> 32" in line and "cannot resume checkpoint step 6" in line, line
  assert "load_parameters_path=" in line and "state:" not in proc.stdout
  assert _files(run_dir) == before  # nothing renamed, nothing written, not even the lease

  # config.yml lost (deleted, a partial copy): the newest config_history entry and the keys saved
  # with the checkpoint still hold the old batch and RoPE; the change is refused naming the record.
  storage.as_path(storage.join(run_dir, "config.yml")).unlink()
  before = _files(run_dir)
  proc = run(cmd + ["per_device_batch_size=4", "rope_max_timescale=500"], env(gcs), expect=2)
  line = _one_error_line(proc)
  assert "cannot resume checkpoint step 6" in line and "rope_max_timescale: 10000 -> 500" in line, line
  assert "global_batch_size: 16 -> 8" in line and "per_device_batch_size x the number of devices" in line, line
  assert "/config_history/" in line and "(config.yml is missing)" in line, line
  assert "the keys saved with checkpoint step 6" in line, line
  assert _files(run_dir) == before  # config.yml is not rewritten with the new values
  # Nothing but the checkpoint itself left (config_history/ lost too).
  for name in storage.listdir(storage.join(run_dir, "config_history")):
    storage.as_path(storage.join(run_dir, "config_history", name)).unlink()
  before = _files(run_dir)
  proc = run(cmd + ["per_device_batch_size=4"], env(gcs), expect=2)
  line = _one_error_line(proc)
  assert "global_batch_size: 16 -> 8" in line and "recorded in the keys saved with checkpoint step 6 (config.yml " \
                                                  "and config_history/ are missing)" in line, line
  assert _files(run_dir) == before

  # A checkpoint from before checkpoints recorded their keys, and no other record: the arrays'
  # stored shapes still catch a changed model, and the step is not mistaken for damage.
  meta = storage.join(run_dir, "checkpoints", "6", "meta", "metadata")
  storage.write_text(meta, json.dumps({k: v for k, v in json.loads(storage.read_text(meta)).items()
                                       if k != "resume_keys"}))
  proc = run(cmd + ["base_emb_dim=32"], env(gcs), expect=2)
  line = _one_error_line(proc)
  assert "checkpoint step 6" in line and "written by another model config" in line and "params/" in line, line
  assert "has no saved configuration" in proc.stdout and "only the stored array shapes are checked" in proc.stdout
  assert committed_steps(run_dir) == [3, 6] and not [n for n in storage.listdir(storage.join(run_dir, "checkpoints"))
                                                     if "corrupt" in n]


@pytest.mark.slow
def test_a_second_run_in_a_busy_run_directory_exits_2_and_the_first_is_untouched(where, lone_run):
  out, gcs = where
  cmd = command(out, "dup", f"steps={STEPS}", "checkpoint_period=5", f"learning_rate_schedule_steps={STEPS}")
  # SIGSTOP holds the first run mid-training (a tiny model would otherwise finish before the
  # second one has started); its lease stays live for the default 180 s.
  first = start_and_signal(cmd, env(gcs), 1, lambda: True, signal.SIGSTOP)
  try:
    second = run(cmd, env(gcs), expect=2)
  finally:
    first.send_signal(signal.SIGCONT)
  line = _one_error_line(second)
  assert "is in use by another run" in line and f"pid {first.pid}" in line, line
  stdout, stderr = first.communicate(timeout=600)
  assert first.returncode == 0, stderr[-3000:]
  run_dir = storage.join(out, "dup")
  lines = storage.read_text(storage.join(run_dir, "metrics.jsonl")).splitlines()
  assert len(lines) == STEPS and all('"loss"' in line for line in lines)  # one record per step, nothing else
  assert losses(run_dir) == lone_run  # bitwise: the second run wrote nothing
  assert not storage.exists(storage.join(run_dir, run_lease.LEASE_FILE))  # released at the end
  assert len(storage.listdir(storage.join(run_dir, "config_history"))) == 1


@pytest.mark.slow
def test_a_dead_runs_lease_is_taken_over_after_the_timeout_and_the_run_resumes(tmp_path, lone_run):
  out = str(tmp_path)
  cmd = command(out, "dup", f"steps={STEPS}", "checkpoint_period=5", f"learning_rate_schedule_steps={STEPS}",
                "run_lease_timeout_seconds=4")
  run_dir = storage.join(out, "dup")
  proc = start_and_signal(cmd, env(None), 12, lambda: 10 in committed_steps(run_dir), signal.SIGKILL)
  proc.communicate(timeout=60)
  killed_at = time.time()
  lease_path = storage.join(run_dir, run_lease.LEASE_FILE)
  lease = json.loads(storage.read_text(lease_path))  # SIGKILL: nobody released it
  assert lease["pid"] == proc.pid
  # As if the run had been on another machine (a lost pod): nobody here can see its process is gone.
  storage.write_text(lease_path, json.dumps({**lease, "host": "lost-pod-0"}))

  # A reader with a long timeout still sees a live holder: exit 2, naming the dead process.
  busy = run(cmd + ["run_lease_timeout_seconds=600"], env(None), expect=2)
  assert f"pid {proc.pid}" in _one_error_line(busy)

  time.sleep(max(0.0, killed_at + 4.5 - time.time()))
  rerun = run(cmd, env(None))
  assert f"taking over the run lease of {run_dir} from host lost-pod-0 pid {proc.pid}" in rerun.stdout
  assert "heartbeat is older than run_lease_timeout_seconds=4" in rerun.stdout
  latest = [line for line in rerun.stdout.splitlines() if line.startswith("state: resumed from step ")]
  assert latest and int(latest[0].split()[4]) >= 10, rerun.stdout[-2000:]
  assert losses(run_dir) == lone_run


@pytest.mark.slow
def test_allowed_changes_resume_normally(tmp_path):
  out = str(tmp_path)
  run(command(out, "grow", "steps=4", "checkpoint_period=2"), env(None))
  more = run(command(out, "grow", "steps=6", "checkpoint_period=3", "log_period=2", "ici_data_parallelism=2",
                     "ici_fsdp_parallelism=1", "run_lease_timeout_seconds=60", "eval_interval=100"), env(None))
  assert "state: resumed from step 4" in more.stdout and "mesh: data=2" in more.stdout, more.stdout[-2000:]
  history = storage.listdir(storage.join(out, "grow", "config_history"))
  assert len(history) == 2  # one entry per start, none overwritten
  assert "ici_data_parallelism: 2" in storage.read_text(storage.join(out, "grow", "config.yml"))


# ---------------------------------------------------------------- tools read the run's configuration

def _tool(gcs, module: str, *args: str, expect: int = 0) -> subprocess.CompletedProcess:
  proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=env(gcs), capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == expect, proc.stdout[-2000:] + proc.stderr[-3000:]
  if expect == 0:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
  return proc


@pytest.fixture(params=[pytest.param("local", marks=pytest.mark.slow), pytest.param("gs", marks=pytest.mark.slow)])
def chain_root(request, tmp_path):
  return _root(request, tmp_path)


def test_fine_tune_chain_needs_no_model_keys_after_the_conversion(chain_root, tmp_path):
  """HF -> hf_to_maxtext -> fine-tune -> params-only export -> maxtext_to_hf -> transformers, and
  the logit checker, with no model key on any command after the conversion."""
  H = pytest.importorskip("hf_families")
  out, gcs = chain_root
  hf_dir = tmp_path / "hf"
  H.build_hf_model("llama3.1").save_pretrained(str(hf_dir))
  converted, params_only, exported = (storage.join(out, name) for name in ("converted", "params-only", "exported"))
  _tool(gcs, "MaxText.convert.hf_to_maxtext", f"hf_model_path={hf_dir}", f"output_path={converted}")

  run_args = [f"base_output_directory={out}", "run_name=ft", "print_config=False"]
  train = _tool(gcs, "MaxText.train", "configs/base.yml", *run_args, f"load_parameters_path={converted}", "steps=2",
                "checkpoint_period=2", "per_device_batch_size=1", "max_target_length=32", "learning_rate=1e-3",
                "cpu_peak_tflops=0.1", "enable_tensorboard=False")
  assert f"using the model keys saved with the checkpoint in {converted}/model_config.yml" in train.stdout

  # A key the user gives that contradicts the run's saved model: one line, exit 2, nothing written.
  wrong = _tool(gcs, "MaxText.generate_param_only_checkpoint", "configs/base.yml", *run_args,
                f"param_only_checkpoint_path={params_only}", "normalization_layer_epsilon=1e-6", expect=2)
  line = _one_error_line(wrong)
  assert "normalization_layer_epsilon=1e-06 (saved: 1e-05)" in line and "config.yml" in line, line
  assert not storage.exists(params_only)

  export = _tool(gcs, "MaxText.generate_param_only_checkpoint", "configs/base.yml", *run_args,
                 f"param_only_checkpoint_path={params_only}")
  assert f"using the model keys saved with the checkpoint in {storage.join(out, 'ft', 'config.yml')}" in export.stdout
  _tool(gcs, "MaxText.convert.maxtext_to_hf", f"load_parameters_path={params_only}", f"output_path={exported}")

  local_hf = tmp_path / "exported-copy"
  storage.copy_tree(exported, str(local_hf))
  hf_config = json.loads((local_hf / "config.json").read_text())
  assert hf_config["rms_norm_eps"] == 1e-5 and hf_config["rope_parameters"]["rope_type"] == "llama3", hf_config
  model, info = H.transformers.AutoModelForCausalLM.from_pretrained(str(local_hf), output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"]
  checker = _tool(gcs, "MaxText.logit_checker", "configs/base.yml", f"load_parameters_path={params_only}",
                  f"hf_model_path={local_hf}", "dtype=float32", "atol=2e-5", "max_kl=1e-9")
  assert "logit_checker: PASS" in checker.stdout


# ---------------------------------------------------------------- the pieces, in process

@pytest.fixture(params=["local", "gs"])
def lease_root(request, tmp_path) -> str:
  return _root(request, tmp_path)[0]


def test_conditional_writes_let_exactly_one_of_racing_writers_win(lease_root):
  import concurrent.futures

  path = storage.join(lease_root, "race", "lease.json")
  assert storage.read_versioned(path) is None
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    versions = list(pool.map(lambda i: storage.write_if(path, f"writer {i}", None), range(8)))
  winners = [i for i, v in enumerate(versions) if v is not None]
  assert len(winners) == 1
  text, version = storage.read_versioned(path)
  assert text == f"writer {winners[0]}"
  assert storage.write_if(path, "another creator", None) is None
  newer = storage.write_if(path, "refreshed", version)
  assert newer is not None and storage.read_versioned(path)[0] == "refreshed"
  assert storage.write_if(path, "late", version) is None  # the old version no longer matches
  assert storage.remove_if(path, newer) and storage.read_versioned(path) is None
  assert not storage.remove_if(path, newer)


def test_lease_refuses_a_live_holder_takes_over_a_stale_one_and_the_loser_notices(lease_root, capsys):
  run_dir = storage.join(lease_root, "run")
  first = run_lease.acquire(run_dir, "run", timeout_seconds=600, processes=2)
  with pytest.raises(run_lease.UserError, match=r"is in use by another run: host .* pid \d+ .*2 process\(es\)"):
    run_lease.acquire(run_dir, "run", timeout_seconds=600, processes=1)
  first._stop.set()  # the holder hangs: no more heartbeats
  first._thread.join()
  time.sleep(1.2)
  second = run_lease.acquire(run_dir, "run", timeout_seconds=1, processes=1)
  assert "taking over the run lease" in capsys.readouterr().out
  first._stop.clear()
  first.refresh()  # the old holder wakes up: its conditional write fails, it learns it lost the lease
  with pytest.raises(run_lease.TrainingError, match="was taken over by host"):
    first.check()
  second.check()
  second.release()
  assert storage.read_versioned(storage.join(run_dir, run_lease.LEASE_FILE)) is None


def test_an_unreadable_lease_or_a_heartbeat_from_a_wrong_clock_is_refused_and_left_alone(lease_root):
  run_dir = storage.join(lease_root, "run")
  path = storage.join(run_dir, run_lease.LEASE_FILE)
  for garbage in (b"\xff\xfe\x00 not text", b'{"host": "h", "pid": 1', b"[]"):
    storage.write_bytes(path, garbage)
    with pytest.raises(run_lease.UserError) as refused:
      run_lease.acquire(run_dir, "run", timeout_seconds=60, processes=1)
    message = str(refused.value)
    assert f"the run lease {path} is unreadable" in message and f"then delete {path} and rerun" in message, message
    assert "heartbeat" not in message
    assert storage.read_bytes(path) == garbage  # nothing written
  now = time.time()
  future = run_lease.Holder("clock-ahead-host", 4242, "run", now, now + 365 * 86400, 1)
  storage.write_text(path, future.to_json())
  with pytest.raises(run_lease.UserError) as refused:
    run_lease.acquire(run_dir, "run", timeout_seconds=60, processes=1)
  message = str(refused.value)
  assert "has a heartbeat 31,536,0" in message and "s in the future (from host clock-ahead-host pid 4242)" in message
  assert "clock" in message and f"then delete {path} and rerun" in message and "expires" not in message, message
  assert storage.read_text(path) == future.to_json()
  # A clock a little ahead (within the timeout) is ordinary skew: a live holder.
  storage.write_text(path, run_lease.Holder("skewed-host", 4242, "run", now, now + 30, 1).to_json())
  with pytest.raises(run_lease.UserError, match="is in use by another run: host skewed-host pid 4242"):
    run_lease.acquire(run_dir, "run", timeout_seconds=60, processes=1)


def test_train_refuses_an_unreadable_lease_with_one_line_and_writes_nothing(tmp_path):
  run_dir = tmp_path / "garbled"
  run_dir.mkdir()
  (run_dir / run_lease.LEASE_FILE).write_bytes(b"\x00\x01garbage")
  proc = run(command(str(tmp_path), "garbled", "steps=2"), env(None), expect=2)
  line = _one_error_line(proc)
  assert f"the run lease {run_dir / run_lease.LEASE_FILE} is unreadable" in line and "then delete" in line, line
  assert sorted(p.name for p in run_dir.iterdir()) == [run_lease.LEASE_FILE]


def test_the_resume_check_falls_back_to_the_newest_history_entry(tmp_path):
  from MaxText.configuration import run_record
  from MaxText.configuration.config import Config
  from MaxText.errors import ConfigError

  history = tmp_path / "config_history"
  history.mkdir()
  for name, dim in (("20260101T000000Z-10", 96), ("20260101T000000Z-2", 80), ("20260101T000000Z", 72),
                    ("20251231T235959Z", 64)):
    (history / f"{name}.yml").write_text(f"base_emb_dim: {dim}\n")
  values, path = run_record.newest_history(str(tmp_path))
  assert values == {"base_emb_dim": 96} and path.endswith("20260101T000000Z-10.yml")
  config = Config.for_testing(base_emb_dim=64, print_config=False)
  with pytest.raises(ConfigError, match=r"base_emb_dim: 96 -> 64, saved -> now; recorded in .*20260101T000000Z-10.yml "
                                        r"\(config.yml is missing\)\)\. Rerun"):
    run_record.check_resume(config, str(tmp_path), "checkpoint step 4")
  (tmp_path / "config.yml").write_text("base_emb_dim: 64\n")  # config.yml, where present, is the run's record
  keys = run_record.resume_keys(config)
  assert run_record.check_resume(config, str(tmp_path), "checkpoint step 4", (keys, "step 4's keys")) == [
      str(tmp_path / "config.yml"), "step 4's keys"]
  with pytest.raises(ConfigError, match=r"vocab_size: 100 -> .*recorded in step 4's keys\)"):
    run_record.check_resume(config, str(tmp_path), "checkpoint step 4", ({**keys, "vocab_size": 100}, "step 4's keys"))


def test_a_kill_mid_write_leaves_one_partial_line_which_the_resume_drops(tmp_path):
  from MaxText.training import metrics

  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
  assert metrics._lines_up_to(str(path), 3) == ['{"step": 1, "loss": 2.0}\n', '{"step": 2, "loss": 1.5}\n']
  path.write_text('{"step": 1, "loss": 2.0}\n39464}\n7\n')  # fragments that are, or almost are, JSON
  assert metrics._lines_up_to(str(path), 5) == ['{"step": 1, "loss": 2.0}\n']
  # Bytes that are not UTF-8 (a damaged disk) were a UnicodeDecodeError traceback at the resume.
  path.write_bytes(b'{"step": 1, "loss": 2.0}\n\xff\xfe{"step": 2}\n{"step": 2, "loss": 1.5}\n')
  assert metrics._lines_up_to(str(path), 5) == ['{"step": 1, "loss": 2.0}\n', '{"step": 2, "loss": 1.5}\n']


def test_garbage_in_metrics_jsonl_is_kept_aside_with_a_warning_not_dropped_silently(tmp_path, capsys):
  """Lines that are no step record, beyond the one a kill cuts short, are a damaged file: the resume rewrote
  metrics.jsonl without them and said nothing."""
  from MaxText.training import metrics

  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
  metrics._lines_up_to(str(path), 3)
  assert "warning" not in capsys.readouterr().out and not list(tmp_path.glob("*.damaged-*"))
  damaged = b'{"step": 1, "loss": 2.0}\n\x00\x00garbage\n[1, 2]\n{"step": 2, "loss": 1.5}\n'
  path.write_bytes(damaged)
  assert metrics._lines_up_to(str(path), 5) == ['{"step": 1, "loss": 2.0}\n', '{"step": 2, "loss": 1.5}\n']
  out = capsys.readouterr().out
  assert out.count("\n") == 1 and "has 2 lines that are no step record (the first is line 2)" in out
  (copy,) = tmp_path.glob("metrics.jsonl.damaged-*")
  assert copy.read_bytes() == damaged and str(copy) in out


@pytest.mark.parametrize("damage, why", [(b"\xff\xfe\x00", "not UTF-8 text"), (b"steps: [3", "while parsing")])
def test_a_damaged_config_record_is_one_line_naming_it(tmp_path, damage, why):
  """config.yml holding bytes that are not UTF-8 was a UnicodeDecodeError traceback at the resume."""
  from MaxText.configuration import run_record
  from MaxText.errors import UserError

  (tmp_path / "config.yml").write_bytes(damage)
  with pytest.raises(UserError, match=f"^{tmp_path / 'config.yml'} is not readable YAML \\({why}.*\\); restore it"):
    run_record.read_saved(str(tmp_path))


def test_a_damaged_config_history_entry_is_not_to_be_restored_from_config_history(tmp_path):
  """With config.yml gone, a damaged newest config_history entry was told to be restored from config_history/,
  the folder that holds it."""
  from MaxText.configuration import run_record
  from MaxText.errors import UserError

  (tmp_path / "config_history").mkdir()
  (tmp_path / "config_history" / "20260101T000000Z.yml").write_bytes(b"\xff\xfe\x00")
  with pytest.raises(UserError, match=r"20260101T000000Z\.yml is not readable YAML \(not UTF-8 text\); move it away "
                                      r"\(out of config_history/\)") as raised:
    run_record.newest_history(str(tmp_path))
  assert "restore it from" not in str(raised.value)


@pytest.mark.parametrize("text, why", [("- a\n", "it holds a list, not key: value lines"), ("a: [1", "not readable YAML"),
                                       ("llama2-7b\n", "it holds a str")])
def test_a_damaged_model_config_beside_a_checkpoint_is_one_line_naming_it(tmp_path, text, why):
  """A parameters-only checkpoint's model_config.yml that is not a mapping was an AttributeError traceback."""
  from MaxText.configuration import run_record
  from MaxText.errors import UserError

  (tmp_path / "model_config.yml").write_text(text)
  with pytest.raises(UserError, match=f"^{tmp_path / 'model_config.yml'} does not hold the checkpoint's model keys "
                                      f"\\({why}.*delete it and give the model keys"):
    run_record.saved_model_keys(str(tmp_path))


def test_fixed_and_allowed_keys_on_resume():
  from MaxText.configuration import run_record

  saved = {"base_emb_dim": 64, "vocab_size": 128, "opt_type": "adamw", "global_batch_size": 16, "steps": 10,
           "ici_fsdp_parallelism": -1, "log_period": 1, "learning_rate_schedule_steps": -1, "mlp_activations": ["silu"]}
  allowed = {**saved, "steps": 50, "ici_fsdp_parallelism": 2, "log_period": 10, "learning_rate_schedule_steps": 50}
  assert run_record.resume_differences(allowed, saved) == []
  changed = {**saved, "base_emb_dim": 32, "opt_type": "sgd", "global_batch_size": 32, "mlp_activations": ["gelu"]}
  assert run_record.resume_differences(changed, saved) == [
      "base_emb_dim: 64 -> 32", "mlp_activations: ['silu'] -> ['gelu']", "opt_type: 'adamw' -> 'sgd'",
      "global_batch_size: 16 -> 32"]
  assert run_record.resume_differences({**saved, "vocab_size": 128.0}, saved) == []  # YAML may read 128 as either


def test_a_resume_naming_the_same_tokenizer_file_another_way_is_no_change(tmp_path, monkeypatch):
  """./tok.model for tok.model, its absolute path or a link to it was "tokenizer_path: 'tok.model' -> './tok.model'":
  the resume refused. Another file is still a change."""
  from MaxText.configuration import run_record

  monkeypatch.chdir(tmp_path)
  (tmp_path / "tok.model").write_bytes(b"x")
  (tmp_path / "other.model").write_bytes(b"y")
  (tmp_path / "link.model").symlink_to(tmp_path / "tok.model")
  saved = {"tokenizer_path": "tok.model", "dataset_path": "data/"}
  for spelling in ("./tok.model", str(tmp_path / "tok.model"), "link.model"):
    assert run_record.resume_differences({**saved, "tokenizer_path": spelling}, saved) == [], spelling
  assert run_record.resume_differences({**saved, "dataset_path": "./data"}, saved) == []
  assert run_record.resume_differences({**saved, "tokenizer_path": "other.model"}, saved) == [
      "tokenizer_path: 'tok.model' -> 'other.model'"]


def test_checkpoints_md_lists_every_key_a_resume_keeps():
  """The table users read is the resume check's own list (it had fallen behind by LoRA, image and GRPO keys)."""
  import re

  from MaxText.configuration import run_record

  text = (REPO_ROOT / "getting_started" / "Checkpoints.md").read_text()
  table = text[text.index("| what they fix | keys |"):]
  named = set(re.findall(r"`([a-z_0-9]+)`", table[:table.index("\n\n")]))
  missing = {kind: [key for key in keys if key not in named] for kind, keys in run_record.FIXED_ON_RESUME.items()
             if not kind.startswith("model")}  # the architecture keys are named by where they are listed
  assert not any(missing.values()), missing


def test_tools_take_the_saved_model_keys_and_refuse_contradicting_ones(tmp_path, capsys):
  from MaxText.configuration import config as config_lib
  from MaxText.errors import ConfigError

  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  (ckpt / "model_config.yml").write_text("base_emb_dim: 96\nnormalization_layer_epsilon: 1.0e-06\nvocab_size: 64\n")
  tool = config_lib.load_config(["t", f"load_parameters_path={ckpt}"], environ={}, reads_run=True)
  assert tool["base_emb_dim"] == 96 and tool["normalization_layer_epsilon"] == 1e-6
  assert "using the model keys saved with the checkpoint in" in capsys.readouterr().out
  same = config_lib.load_config(["t", f"load_parameters_path={ckpt}", "base_emb_dim=96"], environ={}, reads_run=True)
  assert same["base_emb_dim"] == 96
  with pytest.raises(ConfigError, match=r"normalization_layer_epsilon=1e-05 \(saved: 1e-06\): contradicts the model "
                                        r"saved in .*model_config.yml"):
    config_lib.load_config(["t", f"load_parameters_path={ckpt}", "normalization_layer_epsilon=1e-5"], environ={},
                           reads_run=True)
  with pytest.raises(ConfigError, match=r"model_name=llama2-7b contradicts the model saved in .*base_emb_dim=4096"):
    config_lib.load_config(["t", f"load_parameters_path={ckpt}", "model_name=llama2-7b"], environ={}, reads_run=True)
  # Training from these weights may change a key (a fine-tune's choice); the load then checks shapes.
  train = config_lib.load_config(["t", f"load_parameters_path={ckpt}", "normalization_layer_epsilon=1e-5"], environ={})
  assert train["normalization_layer_epsilon"] == 1e-5 and train["base_emb_dim"] == 96

  run_dir = tmp_path / "runs" / "r"
  (run_dir / "checkpoints" / "4").mkdir(parents=True)
  (run_dir / "config.yml").write_text("base_emb_dim: 80\nsteps: 4\nderived: {global_batch_size: 8}\n")
  for path in (run_dir, run_dir / "checkpoints", run_dir / "checkpoints" / "4"):
    assert config_lib.load_config(["t", f"load_full_state_path={path}"], environ={}, reads_run=True)["base_emb_dim"] == 80
  by_run_name = ["t", f"base_output_directory={tmp_path / 'runs'}", "run_name=r"]
  assert config_lib.load_config(by_run_name, environ={}, reads_run=True)["base_emb_dim"] == 80
  assert config_lib.load_config(by_run_name, environ={})["base_emb_dim"] != 80  # train.py resumes by its own keys


def test_another_runs_full_state_saved_with_another_optimizer_is_refused_before_anything_is_read(tiny_overrides,
                                                                                                tmp_path):
  """adamw's and adam_pax's states have one layout: load_full_state_path from an adamw run loaded silently into
  an adam_pax run, AdamW's moments read as Pax's. Now the source run's record is checked as a resume's, but for
  the data position (a new run may read other data)."""
  from MaxText import train
  from MaxText.configuration.config import Config
  from MaxText.errors import ConfigError

  source = tmp_path / "src"
  (source / "checkpoints").mkdir(parents=True)
  (source / "config.yml").write_text(Config.for_testing(**tiny_overrides, opt_type="adamw").to_yaml())
  args = ["train", "configs/base.yml", *(f"{k}={v}" for k, v in tiny_overrides.items()), "steps=1",
          f"base_output_directory={tmp_path}", "run_name=new", f"load_full_state_path={source / 'checkpoints'}"]
  with pytest.raises(ConfigError) as error:
    train.main([*args, "opt_type=adam_pax"])
  assert str(error.value) == (
      f"load_full_state_path={source / 'checkpoints'}: its run ({source / 'config.yml'}) saved the state with other "
      "values of key(s) that fix its shape or meaning (opt_type: 'adamw' -> 'adam_pax', saved -> now). Set them as "
      f"saved, or start from its weights alone with load_parameters_path={source / 'checkpoints'} (a fresh optimizer "
      "state)")
  assert not (tmp_path / "new" / "config.yml").exists() and not (tmp_path / "new" / "metrics.jsonl").exists()
  with pytest.raises(UserError, match="holds no complete checkpoint"):  # other data keys pass the check
    train.main([*args, "dataset_type=synthetic", "data_shuffle_seed=7"])
