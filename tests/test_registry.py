"""The built-in target's one-time GGUF conversion, when several processes start at once."""
import tempfile
import threading
from pathlib import Path

from treeflash.models.registry import is_converted, publish_dir


def converted_copy(parent: Path, name: str, tag: str) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=name + ".tmp-", dir=parent))
    (tmp / "config.json").write_text(tag)
    (tmp / "model.safetensors").write_text(tag)
    return tmp


def test_concurrent_conversions_leave_one_complete_copy(tmp_path):
    """Eight writers publish at once, over and over, onto an incomplete leftover: no two may share a
    temporary directory, and a writer must not delete the leftover in place while another renames
    onto it (ENOTEMPTY). Every writer returns, and the cache holds one writer's files."""
    for rnd in range(20):
        out = tmp_path / f"smollm2-135m-{rnd}"
        out.mkdir()
        (out / "config.json").write_text("partial")  # an interrupted copy: no weights
        errors, start = [], threading.Barrier(8)

        def writer(i):
            tmp = converted_copy(tmp_path, out.name, f"w{i}")
            start.wait()
            try:
                publish_dir(tmp, out)
            except Exception as e:  # noqa: BLE001 (collected for the assert)
                errors.append(e)

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert is_converted(out)
        tag = (out / "config.json").read_text()
        assert (out / "model.safetensors").read_text() == tag and tag in {f"w{i}" for i in range(8)}


def test_an_incomplete_leftover_is_replaced_and_a_complete_cache_kept(tmp_path):
    out = tmp_path / "t"
    out.mkdir()
    (out / "config.json").write_text("partial")  # no weights: an interrupted copy
    publish_dir(converted_copy(tmp_path, "t", "new"), out)
    assert (out / "model.safetensors").read_text() == "new"
    second = converted_copy(tmp_path, "t", "later")
    publish_dir(second, out)
    assert (out / "config.json").read_text() == "new" and second.exists()  # the caller removes its copy
