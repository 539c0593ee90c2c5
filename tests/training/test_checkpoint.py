import collections
import decimal
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

from autoaccum.state import capture_rng, restore_rng
from autoaccum.training.checkpoint import (
    CHECKPOINT_NAME,
    CheckpointError,
    check_writable,
    load_checkpoint,
    rng_from_plain,
    rng_to_plain,
    save_checkpoint,
)
from autoaccum.training.lr import warmup_lambda


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.25), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 3))


def _train(model, opt, sched, steps):
    for _ in range(steps):
        x = torch.randn(8, 6)
        y = torch.randint(0, 3, (8,))
        loss = torch.nn.functional.cross_entropy(model(x), y) * random.uniform(0.5, 1.5)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def _assert_same(a, b, where="state"):
    """Equal values of equal types all the way down; tensors with torch.equal and equal dtype."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
        return
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), where
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _training_state(model, opt, sched, step):
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": rng_to_plain(capture_rng()),
        "counters": {"step": step, "samples": step * 8, "epoch": 0, "shuffle_seed": 1234},
        "plan": {"micro_batch": 4, "accum_steps": 2, "world_size": 1, "target_batch": 8},
        "loss": 0.5,
        "note": None,
    }


# --- round trip ---

def test_round_trip_model_adamw_scheduler_rng_resumes_bit_exactly(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda(3))
    random.seed(7)
    _train(model, opt, sched, 2)
    random.gauss(0, 1)  # leaves Python's gauss_next set: that part of the state must survive too
    state = _training_state(model, opt, sched, 2)
    assert state["rng"]["python_gauss_next"] is not None

    save_checkpoint(tmp_path / CHECKPOINT_NAME, state)
    loaded = load_checkpoint(tmp_path)
    _assert_same(state, loaded)

    # the uninterrupted run goes on for 3 steps from here
    _train(model, opt, sched, 3)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    draws = (random.random(), random.gauss(0, 1), torch.rand(4))

    def resume(restore_generators: bool) -> torch.nn.Module:
        """Fresh objects, everything taken from the checkpoint, then the same 3 steps."""
        torch.manual_seed(99)
        random.seed(99)
        model2 = _model()
        opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
        sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, warmup_lambda(3))
        model2.load_state_dict(loaded["model"])
        opt2.load_state_dict(loaded["optimizer"])
        sched2.load_state_dict(loaded["scheduler"])
        if restore_generators:
            restore_rng(rng_from_plain(loaded["rng"]))
        _train(model2, opt2, sched2, 3)
        return model2

    resumed = resume(restore_generators=True)
    for name, tensor in resumed.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    resumed_draws = (random.random(), random.gauss(0, 1), torch.rand(4))
    assert resumed_draws[:2] == draws[:2]
    assert torch.equal(resumed_draws[2], draws[2])
    # negative control: without the RNG state, dropout and the data draw differ
    unseeded = resume(restore_generators=False)
    assert not all(torch.equal(t, reference[n]) for n, t in unseeded.state_dict().items())


def test_rng_plain_round_trip_through_weights_only(tmp_path):
    random.seed(3)
    torch.manual_seed(3)
    random.gauss(0, 1)
    rng = capture_rng()
    plain = rng_to_plain(rng)
    torch.save(plain, tmp_path / "rng.pt")
    back = rng_from_plain(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert back.python == rng.python  # the tuple, its 625 ints and gauss_next, exactly
    assert torch.equal(back.cpu, rng.cpu) and back.cpu.dtype == torch.uint8
    assert back.cuda is None
    expected = (random.random(), random.gauss(0, 1), torch.randn(3))
    restore_rng(back)
    assert (random.random(), random.gauss(0, 1)) == expected[:2]
    assert torch.equal(torch.randn(3), expected[2])


def test_rng_from_plain_names_missing_keys():
    plain = rng_to_plain(capture_rng())
    del plain["cpu"]
    with pytest.raises(ValueError, match="missing cpu"):
        rng_from_plain(plain)


def test_rng_to_plain_does_not_change_the_generators():
    before = capture_rng()
    rng_to_plain(before)
    after = capture_rng()
    assert after.python == before.python and torch.equal(after.cpu, before.cpu)


# --- layout: newest and previous ---

class _Config:
    pass


def _state(step: int) -> dict:
    return {"step": step, "marker": torch.full((100,), float(step))}


def test_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "run" / "ckpt.pt"  # parent directories are created
    for step in (1, 2, 3):
        save_checkpoint(path, _state(step))
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt.pt", "ckpt.pt.prev"]
    assert torch.load(path, weights_only=True)["step"] == 3
    assert torch.load(path.with_name("ckpt.pt.prev"), weights_only=True)["step"] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the newest is fine: no warning
        assert load_checkpoint(path)["step"] == 3


def test_directory_argument_uses_checkpoint_pt(tmp_path):
    save_checkpoint(tmp_path, _state(1))
    assert (tmp_path / CHECKPOINT_NAME).is_file()
    assert load_checkpoint(tmp_path)["step"] == 1
    assert load_checkpoint(str(tmp_path / CHECKPOINT_NAME))["step"] == 1


def test_nothing_to_load_returns_none(tmp_path):
    assert load_checkpoint(tmp_path) is None
    assert load_checkpoint(tmp_path / "absent" / "ckpt.pt") is None


def test_truncated_newest_falls_back_to_previous_with_one_warning(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, _state(1))
    save_checkpoint(path, _state(2))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.warns(RuntimeWarning, match="previous") as record:
        loaded = load_checkpoint(path)
    assert len(record) == 1
    assert "ckpt.pt" in str(record[0].message)
    _assert_same(loaded, _state(1))


def test_flipped_byte_in_newest_falls_back(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, _state(1))
    save_checkpoint(path, _state(2))
    data = bytearray(path.read_bytes())
    at = data.find(struct.pack("<100f", *[2.0] * 100))  # the marker tensor's bytes (little-endian fp32)
    assert at > 0
    data[at + 10] ^= 0xFF
    path.write_bytes(bytes(data))
    # negative control: torch.load alone accepts the damaged file and returns a wrong tensor
    damaged = torch.load(path, weights_only=True)
    assert not torch.equal(damaged["marker"], _state(2)["marker"])
    with pytest.warns(RuntimeWarning, match="CRC"):
        loaded = load_checkpoint(path)
    assert loaded["step"] == 1


def test_missing_newest_falls_back_to_previous(tmp_path):
    # what a kill between the two renames leaves
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, _state(1))
    save_checkpoint(path, _state(2))
    path.unlink()
    with pytest.warns(RuntimeWarning, match="missing"):
        assert load_checkpoint(path)["step"] == 1


def test_no_readable_checkpoint_raises(tmp_path):
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"not a checkpoint")
    (tmp_path / "ckpt.pt.prev").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"ckpt\.pt: .*ckpt\.pt\.prev: "):
        load_checkpoint(path)


def test_a_pickled_object_is_not_loaded(tmp_path):
    # a file someone wrote with arbitrary objects is refused, never unpickled
    path = tmp_path / "ckpt.pt"
    torch.save({"step": 1, "odd": _Config()}, path)
    with pytest.raises(CheckpointError, match="ckpt.pt"):
        load_checkpoint(path)


def test_temp_files_are_ignored_and_cleaned(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, _state(1))
    stale = tmp_path / ".ckpt.pt.abc123.tmp"
    stale.write_bytes(b"half a checkpoint")
    assert load_checkpoint(path)["step"] == 1
    save_checkpoint(path, _state(2))
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "ckpt.pt.prev"]


# --- refusing what weights_only cannot load ---

@pytest.mark.parametrize(("value", "where"), [
    ({"extra": {"cfg": [1, _Config()]}}, r"state\['extra'\]\['cfg'\]\[1\]"),
    ({"lr": decimal.Decimal("0.1")}, r"state\['lr'\]"),
    ({"seen": {1, 2}}, r"state\['seen'\]"),
    ({"blob": b"\x00"}, r"state\['blob'\]"),
    ({"dtype": torch.float32}, r"state\['dtype'\]"),
    ({"counts": collections.defaultdict(int)}, r"state\['counts'\]"),
    ({"pair": collections.namedtuple("Pair", "a b")(1, 2)}, r"state\['pair'\]"),
    ({"opt": {"state": {0: {"fn": len}}}}, r"state\['opt'\]\['state'\]\[0\]\['fn'\]"),
    ({"nested": ({1.5: 2},)}, r"state\['nested'\]\[0\] has a key 1\.5"),
])
def test_non_plain_values_are_refused_before_writing(tmp_path, value, where):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, _state(1))
    with pytest.raises(TypeError, match=where):
        save_checkpoint(path, {"model": {"w": torch.zeros(2)}, **value})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # nothing written, nothing rotated
    assert load_checkpoint(path)["step"] == 1


def test_state_must_be_a_dict(tmp_path):
    with pytest.raises(TypeError, match="state must be a dict"):
        save_checkpoint(tmp_path / "ckpt.pt", [1, 2])


def test_cycle_is_refused(tmp_path):
    loop = []
    loop.append(loop)
    with pytest.raises(ValueError, match=r"state\['loop'\]\[0\] contains itself"):
        save_checkpoint(tmp_path / "ckpt.pt", {"loop": loop})


def test_shared_values_are_not_mistaken_for_a_cycle(tmp_path):
    shared = [1, 2]
    save_checkpoint(tmp_path / "ckpt.pt", {"a": shared, "b": shared, "t": torch.nn.Parameter(torch.ones(2))})
    assert load_checkpoint(tmp_path / "ckpt.pt")["b"] == [1, 2]


# --- check_writable ---

def test_check_writable_creates_the_directory(tmp_path):
    target = tmp_path / "a" / "b"
    assert check_writable(target) == target.resolve()
    assert target.is_dir()
    assert list(target.iterdir()) == []  # the write test leaves nothing behind


def test_check_writable_refuses_a_path_under_a_file(tmp_path):
    # chmod does not stop root; a path under a regular file cannot be created by anyone
    (tmp_path / "file.txt").write_text("x")
    target = tmp_path / "file.txt" / "ckpt"
    with pytest.raises(ValueError, match=r"Invalid checkpoint_dir: .*file\.txt/ckpt.* cannot be written.*Pass a"):
        check_writable(target)


def test_check_writable_refuses_a_file(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match=r"file\.txt"):
        check_writable(tmp_path / "file.txt")


def test_check_writable_type():
    with pytest.raises(TypeError, match="checkpoint_dir must be a str or os.PathLike"):
        check_writable(3)


# --- SIGKILL in the middle of writing ---

_WRITER = textwrap.dedent('''
    import os, signal, sys
    import torch
    torch.set_num_threads(1)  # no thread pool before fork
    from autoaccum.training.checkpoint import save_checkpoint

    path = sys.argv[1]
    # 4 MB in 32 records: the file grows record by record, so a kill can land half-way
    payload = [c.clone() for c in torch.arange(1_000_000, dtype=torch.float32).chunk(32)]

    def kill_at(module, name, nth):
        """SIGKILL this process at the nth call of module.name: a crash at an exact point."""
        real, calls = getattr(module, name), [0]
        def wrapper(*args, **kwargs):
            calls[0] += 1
            if calls[0] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        setattr(module, name, wrapper)

    class KillAtWrite:
        """A file that writes half of its nth write, flushes, and SIGKILLs the process."""
        def __init__(self, f, nth):
            self._f, self._left = f, nth
        def write(self, data):
            self._left -= 1
            if self._left == 0:
                self._f.write(bytes(data)[: len(data) // 2])
                self._f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return self._f.write(data)
        def __getattr__(self, name):
            return getattr(self._f, name)
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

    def write_forever(mode, base):
        if mode.startswith("write:"):
            real_fdopen, nth = os.fdopen, int(mode.split(":")[1])
            os.fdopen = lambda *args, **kwargs: KillAtWrite(real_fdopen(*args, **kwargs), nth)
        elif mode != "loop":
            name, nth = mode.split(":")
            kill_at(os, name, int(nth))
        step = base
        while True:
            step += 1
            save_checkpoint(path, {"step": step, "marker": torch.full((1000,), float(step)), "payload": payload})

    for line in sys.stdin:
        mode, base = line.split()
        if mode == "stop":
            break
        pid = os.fork()
        if pid == 0:
            # the child saves until it is SIGKILLed; an error ends it with its traceback and exit
            # status 1 (it propagates out of this loop: the child never runs the parent's next line)
            write_forever(mode, int(base))
            raise SystemExit(1)  # not reached: write_forever only ends by an error or SIGKILL
        print(pid, flush=True)
        print(os.waitpid(pid, 0)[1], flush=True)
''')


def _big_state(step):
    return {"step": step, "marker": torch.full((1000,), float(step)),
            "payload": [c.clone() for c in torch.arange(1_000_000, dtype=torch.float32).chunk(32)]}


def _check_valid(state, at_least):
    assert state is not None
    step = state["step"]
    assert step >= at_least
    assert torch.equal(state["marker"], torch.full((1000,), float(step)))
    assert torch.equal(torch.cat(state["payload"]), torch.arange(1_000_000, dtype=torch.float32))
    return step


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_sigkill_during_writes_never_leaves_a_corrupt_newest(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    ckpt = tmp_path / "ckpt" / "ckpt.pt"
    save_checkpoint(ckpt, _big_state(1))
    server = subprocess.Popen([sys.executable, str(script), str(ckpt)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rng = random.Random(0)

    def run(mode, base, kill_after_s=None):
        server.stdin.write(f"{mode} {base}\n")
        server.stdin.flush()
        pid = int(server.stdout.readline())
        if kill_after_s is not None:
            time.sleep(kill_after_s)
            os.kill(pid, signal.SIGKILL)
        status = int(server.stdout.readline())
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
            server.kill()  # the writer failed instead of being killed: show why
            pytest.fail(f"writer exited with status {status}: {server.stderr.read()}")

    def load(at_least):
        """Load after a kill: valid, and never a fallback past a corrupt newest file (only past a
        missing one, which a kill between the two renames leaves)."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = _check_valid(load_checkpoint(ckpt), at_least)
        messages = [str(w.message) for w in caught]
        assert all(m.endswith(": missing)") for m in messages), messages
        return step, messages

    try:
        # kills at random moments of a loop of saves
        last = 1
        for round_ in range(1, 7):
            run("loop", 1000 * round_, kill_after_s=rng.uniform(0.0, 0.12))
            last, _ = load(last)
        # kills at exact points of the first save after a good one: half-way through writing the
        # temp file, before its fsync, before rotating, between the two renames (second save)
        for round_, mode in ((7, "write:100"), (8, "fsync:1"), (9, "replace:1"), (10, "replace:4")):
            base = 1000 * round_
            save_checkpoint(ckpt, _big_state(base))
            run(mode, base)
            step, messages = load(base)
            temp_files = list(ckpt.parent.glob(".*.tmp"))
            if mode == "write:100":
                # negative control: a writer without temp file and rename would have left this
                # truncated file as the newest checkpoint
                assert len(temp_files) == 1
                with pytest.raises(Exception):
                    torch.load(temp_files[0], weights_only=True)
            if mode == "replace:4":  # killed with <name> renamed away: the previous one is the newest
                assert not ckpt.exists() and step == base + 1 and len(messages) == 1
            else:
                assert step == base and messages == []
    finally:
        if server.poll() is None:
            server.stdin.write("stop 0\n")
        server.communicate(timeout=10)  # closes the pipes
