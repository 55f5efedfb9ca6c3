"""Byte corpus: reading files and folders, clear errors, deterministic rank-disjoint sampling, resumable position."""

import pytest
import torch

from infinity.train.data import ByteCorpus, default_corpus_path, read_corpus_bytes
from infinity.config.lr_schedule import lr_at

pytestmark = pytest.mark.device_independent  # the distinct-device pass leaves it out


def _corpus(data: bytes, **kw) -> ByteCorpus:
    kw.setdefault("seq_len", 8)
    kw.setdefault("micro_batch", 2)
    return ByteCorpus(data=data, **kw)


def test_targets_are_inputs_shifted_by_one_byte():
    data = bytes(range(256)) * 4
    c = _corpus(data)
    x, y = c.next_batch()
    assert x.dtype == torch.int64 and x.shape == (2, 8) and y.shape == (2, 8)
    for row_x, row_y in zip(x, y):
        start = data.index(bytes(row_x.tolist()))
        assert bytes(row_y.tolist()) == data[start + 1:start + 9]
        assert start % 8 == 0  # windows are cut at multiples of seq_len


def test_same_seed_same_stream_other_seed_other_stream():
    data = bytes(range(256)) * 20
    a, b, other = _corpus(data, seed=3), _corpus(data, seed=3), _corpus(data, seed=4)
    batches_a = [a.next_batch()[0] for _ in range(5)]
    batches_b = [b.next_batch()[0] for _ in range(5)]
    batches_o = [other.next_batch()[0] for _ in range(5)]
    assert all(torch.equal(p, q) for p, q in zip(batches_a, batches_b))
    assert not all(torch.equal(p, q) for p, q in zip(batches_a, batches_o))


def test_ranks_get_disjoint_windows_that_together_are_the_single_rank_stream():
    data = bytes((i * 7) % 251 for i in range(8 * 64 + 1))  # 64 windows, no two alike
    single = _corpus(data, micro_batch=4)
    ranks = [_corpus(data, micro_batch=2, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        whole = single.next_batch()[0]
        parts = [c.next_batch()[0] for c in ranks]
        rows = [tuple(r.tolist()) for p in parts for r in p]
        assert len(set(rows)) == len(rows)  # no window twice in one step
        assert torch.equal(torch.cat(parts), whole)


def test_an_epoch_visits_every_window_once():
    data = bytes((i * 13) % 251 for i in range(8 * 10 + 1))
    c = _corpus(data, micro_batch=5)
    seen = [tuple(r.tolist()) for _ in range(2) for r in c.next_batch()[0]]
    assert len(set(seen)) == 10 == c.num_windows


def test_state_dict_resumes_the_same_stream():
    data = bytes(range(256)) * 8
    a = _corpus(data, seed=1)
    for _ in range(3):
        a.next_batch()
    state = a.state_dict()
    expected = [a.next_batch()[0] for _ in range(4)]
    b = _corpus(data, seed=1)
    b.load_state_dict(state)
    assert all(torch.equal(p, q) for p, q in zip(expected, [b.next_batch()[0] for _ in range(4)]))


def test_state_dict_of_another_corpus_is_refused():
    state = _corpus(bytes(100), seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1 in the state, 2 here"):
        _corpus(bytes(100), seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_bytes"):
        _corpus(bytes(200), seed=1).load_state_dict(state)


def test_folder_is_read_recursively_in_sorted_order_skipping_binary(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_bytes(b"third")
    (tmp_path / "a.txt").write_bytes(b"first")
    (tmp_path / "b" / "a.txt").write_bytes(b"second")
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2binary")
    (tmp_path / ".hidden").write_bytes(b"hidden")
    data, description = read_corpus_bytes(tmp_path)
    assert data == b"firstsecondthird"
    assert "3 files" in description


def test_max_bytes_caps_a_folder_and_a_file(tmp_path):
    for i in range(5):
        (tmp_path / f"{i}.txt").write_bytes(b"x" * 100)
    assert len(read_corpus_bytes(tmp_path, max_bytes=250)[0]) == 250
    assert len(read_corpus_bytes(tmp_path / "0.txt", max_bytes=10)[0]) == 10


def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "no_such_corpus"
    with pytest.raises(FileNotFoundError, match="no_such_corpus.*does not exist"):
        ByteCorpus(missing, seq_len=8, micro_batch=1)


def test_empty_file_and_empty_folder_are_named(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.txt.*is empty"):
        ByteCorpus(empty, seq_len=8, micro_batch=1)
    folder = tmp_path / "nothing"
    folder.mkdir()
    (folder / "only_binary.bin").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match="nothing.*is empty"):
        ByteCorpus(folder, seq_len=8, micro_batch=1)


def test_corpus_shorter_than_one_window_is_refused(tmp_path):
    f = tmp_path / "short.txt"
    f.write_bytes(b"abc")
    with pytest.raises(ValueError, match="short.txt.*3 bytes.*seq_len \\+ 1 = 9"):
        ByteCorpus(f, seq_len=8, micro_batch=1)


def test_default_corpus_is_the_standard_library_source():
    c = ByteCorpus(seq_len=64, micro_batch=2, max_bytes=200_000)
    assert c.num_bytes == 200_000
    assert str(default_corpus_path()) in c.description
    x, _ = c.next_batch()
    assert int(x.max()) < 256


def test_bad_rank_or_sizes_are_refused():
    with pytest.raises(ValueError, match="rank 2 is outside world_size 2"):
        _corpus(bytes(100), rank=2, world_size=2)
    with pytest.raises(ValueError, match="positive"):
        _corpus(bytes(100), seq_len=0)


def test_lr_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    kw = dict(peak_lr=1.0, warmup_steps=4, total_steps=14, min_lr=0.1)
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert 0.9 < lr_at(4, **kw) < 1.0  # the decay starts right after the peak
    assert lr_at(8, **kw) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the 10 decay steps
    assert lr_at(13, **kw) == pytest.approx(0.1)
    assert lr_at(100, **kw) == pytest.approx(0.1)
    decay = [lr_at(s, **kw) for s in range(4, 14)]
    assert decay == sorted(decay, reverse=True)
    assert lr_at(0, peak_lr=1.0, warmup_steps=1, total_steps=1) == 1.0
    assert lr_at(0, peak_lr=1.0, warmup_steps=0, total_steps=2) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="min_lr"):
        lr_at(0, peak_lr=1.0, warmup_steps=0, total_steps=5, min_lr=2.0)
