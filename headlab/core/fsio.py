"""Output files written all or nothing: atomic directories and files, the existing-output check, JSON output.

Every command's results go through here, so a crash or an interrupt never leaves a half-written run behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import time
from pathlib import Path

from headlab import __version__
from headlab.core.errors import HeadlabError


def check_out(out: Path | None, overwrite: bool, option: str = "out") -> None:
    """Fail before any work when the output exists and --overwrite was not given, or when it is something headlab
    must not replace even with --overwrite (`check_replaceable`)."""
    if out is None or not os.path.lexists(Path(out)):
        return
    if not overwrite:
        raise HeadlabError(f"{out} already exists; pass overwrite=True to replace it")
    check_replaceable(out, option)


# ---- what --overwrite may replace: a previous headlab output, or an empty folder ---------------------------------

# The record every headlab output directory carries at its top level: meta.json (run directories, reports, demos),
# headlab.json (checkpoints), headlab_source.json (the embedded model's converted copy in the cache).
RECORD_FILES = ("meta.json", "headlab.json", "headlab_source.json")
GGUF_MARK = "headlab.version"  # the metadata key export-gguf writes into every GGUF file (right after the architecture)
_GGUF_HEAD = 64 * 1024  # the mark lies within the first KiB of a file headlab wrote; read at most this much


def _headlab_record(folder: Path) -> str | None:
    """The record file (a JSON object) that marks `folder` as a headlab output, or None."""
    for name in RECORD_FILES:
        try:
            if isinstance(json.loads((folder / name).read_text()), dict):
                return name
        except (OSError, ValueError):
            continue
    return None


def _headlab_gguf(path: Path) -> bool:
    """A GGUF file export-gguf wrote: the GGUF magic, and headlab's metadata key among the first key-value pairs."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(_GGUF_HEAD)
    except OSError:
        return False
    return head.startswith(b"GGUF") and GGUF_MARK.encode() in head


def replace_refusal(path) -> str | None:
    """Why an existing `path` must not be replaced even with overwrite (None: it may be): headlab replaces only what
    it wrote itself (a folder holding a headlab record, a GGUF file with headlab's mark) or an empty folder. A user's
    file, a folder of other files, a FIFO, a device, a socket or a mount point is never deleted. A symbolic link is
    judged by what it points to (publishing replaces the link, never its target)."""
    path = Path(path).expanduser()
    if not os.path.lexists(path):
        return None
    try:
        info = os.stat(path)
    except OSError:  # a dangling link: replacing it loses nothing
        return None
    if os.path.ismount(real(path)):
        return "is a mount point"
    if stat.S_ISDIR(info.st_mode):
        try:
            empty = not any(os.scandir(path))
        except OSError as error:
            return f"cannot be read ({error.strerror})"
        if empty or _headlab_record(path):
            return None
        return f"holds files headlab did not write (no {' or '.join(RECORD_FILES[:2])})"
    if stat.S_ISREG(info.st_mode):
        return None if _headlab_gguf(path) else "is a file headlab did not write"
    kind = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
            stat.S_IFSOCK: "a socket"}.get(stat.S_IFMT(info.st_mode), "not a regular file or folder")  # fmt: skip
    return f"is {kind}"


def check_replaceable(out, option: str = "out") -> None:
    """Refuse, in one line, to replace an existing `out` that headlab did not write (see `replace_refusal`)."""
    reason = replace_refusal(out)
    if reason is not None:
        raise HeadlabError(
            f"{_named(option, out)} {reason}; overwrite=True replaces only a previous headlab output or an empty folder: "
            "move it away or choose another"
        )


# ---- the output guard: one check, before any work, for every command that writes -------------------------------

RUN_DIR_BYTES = 16 * 2**20  # free space a run directory of tables, figures and metadata needs at most (assumed)


def real(path) -> Path:
    """`path` with ~ expanded and every symlink resolved (also in a not-yet-existing tail's existing prefix)."""
    return Path(os.path.realpath(Path(path).expanduser()))


def _relation(out: Path, source: Path) -> str | None:
    if out == source:
        return "is"
    if out in source.parents:
        return "contains"
    if source in out.parents:
        return "lies inside"
    return None


def existing_ancestor(path: Path) -> Path:
    """The nearest part of `path` (itself or a parent) that exists: where its directories would be created."""
    path = Path(os.path.abspath(Path(path).expanduser()))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def _named(option: str, value) -> str:
    """How a message names an output: `--out PATH` for a command-line option, `out=PATH` for a parameter name."""
    return f"{option} {value}" if option.startswith("-") else f"{option}={value}"


def guard_output(out, overwrite: bool, inputs: dict[str, object], *, option: str = "out", replaceable=None) -> None:
    """The one output guard, before any work: `out` must not be, contain or lie inside any input (symlinks resolved),
    nor the working directory or one above it; it must not exist unless `overwrite` (or `replaceable(out)`, e.g. a
    previous demo); and where it will be created must be a writable directory. `inputs`: label -> path of every
    file or directory the run reads (None for inputs that are not local paths: hub ids, the embedded corpus).
    Refusals are HeadlabErrors naming the option (`option`: the parameter or option the output was given as), the
    path and the input."""
    if out is None:
        return
    check_output_name(out, option)
    target = real(out)
    here = real(Path.cwd())
    if _relation(target, here) in ("is", "contains"):
        raise HeadlabError(f"{_named(option, out)} is the working directory or holds it; name a new directory")
    for label, source in inputs.items():
        if source is None or not os.path.lexists(Path(source).expanduser()):
            continue
        for where in _resolved_parts(Path(source).expanduser()):
            relation = _relation(target, where)
            if relation is not None:
                via = "" if where == real(source) else f" (through the link to {where})"
                raise HeadlabError(
                    f"{_named(option, out)} {relation} the {label} {source}{via}, a source this command reads; choose "
                    "another"
                )
    for label, source in inputs.items():
        if source is not None and os.path.exists(Path(source).expanduser()):
            check_readable(label, Path(source).expanduser())
    if os.path.lexists(Path(out)):
        if not overwrite and not (replaceable and replaceable(Path(out))):
            raise HeadlabError(f"{out} already exists; pass overwrite=True to replace it")
        if not os.path.isdir(out):  # a file, FIFO or device: never headlab's unless a GGUF it wrote
            check_replaceable(out, option)
        # An existing folder is checked by check_free_space (every command that replaces a whole folder calls it
        # right after this guard): `plot` also passes here, and writes its figures into a folder it does not replace.
    check_writable(out, option)


def check_output_name(out, option: str = "out") -> None:
    """An output path headlab writes exactly where it says: not starting with a `~` the shell did not expand (a
    quoted '~/x': writing a folder named `~` would surprise; expanding it would differ from what the shell does),
    and valid UTF-8 (the name is printed and recorded in meta.json)."""
    text = str(out)
    if text.startswith("~"):
        raise HeadlabError(
            f"{_named(option, out)} starts with a ~ the shell did not expand (was it quoted?); write the path out, "
            f"e.g. {Path(text).expanduser()}"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(text).decode("utf-8", "backslashreplace")
        raise HeadlabError(f"{_named(option, shown)}: the path is not valid UTF-8; choose a UTF-8 name") from None


def _resolved_parts(source: Path, most: int = 100_000) -> list[Path]:
    """Where an input really lives: the path resolved, and for a directory also every symlink inside it resolved,
    since a model folder's files may be links into another folder (the Hugging Face cache links each snapshot file
    into blobs/). At most `most` entries are walked (a corpus directory of many files)."""
    parts = [real(source)]
    if source.is_dir():
        for count, (folder, dirs, files) in enumerate(os.walk(source)):
            for name in dirs + files:
                path = Path(folder) / name
                if path.is_symlink():
                    parts.append(real(path))
            if count >= most:
                break
    return list(dict.fromkeys(parts))


def check_readable(label: str, source: Path) -> None:
    """An input (a file, or a directory and the files directly in it) can be read, before any work starts."""
    paths = [source]
    if source.is_dir():
        if not os.access(source, os.R_OK | os.X_OK):
            raise HeadlabError(f"cannot read the {label} {source}: permission denied")
        paths = sorted(p for p in source.iterdir() if p.is_file())
    for path in paths:
        if not os.access(path, os.R_OK):
            raise HeadlabError(f"cannot read the {label} {path}: permission denied")


def check_writable(out, option: str = "out") -> None:
    """The directory that will hold `out` (or the nearest existing one above it) is a directory we may write in."""
    parent = existing_ancestor(Path(out).expanduser().parent if Path(out).name else out)
    if not parent.is_dir():
        raise HeadlabError(f"{_named(option, out)}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):  # also False on a read-only file system (EROFS)
        raise HeadlabError(
            f"{_named(option, out)}: cannot write in {parent} (permission denied or read-only file system)"
        )


def check_free_space(out, needed: int, how: str, option: str = "out") -> None:
    """Free space where `out` will be written is at least `needed` bytes (`how`: how that was estimated). With
    --overwrite the old output stays until the new one is in place, so nothing it holds counts as free; and it is
    replaced only if headlab wrote it (`check_replaceable`: every command that replaces a whole output calls this
    right after guard_output, before any work)."""
    if os.path.lexists(Path(out)):
        check_replaceable(out, option)
    parent = existing_ancestor(Path(out).expanduser().parent)
    free = shutil.disk_usage(parent).free
    if free < needed:
        raise HeadlabError(
            f"{_named(option, out)}: {_size(free)} free on the file system of {parent}, the output needs about "
            f"{_size(needed)} ({how}); free some space or write elsewhere"
        )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# ---- race-free publication -----------------------------------------------------------------------------------

_AT_FDCWD = -100
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2  # linux/fs.h
_LOCK_SUFFIX = ".headlab-lock"


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux renameat2(2) through libc: True when done; False where the call or the flag is unsupported (other
    systems, old kernels, some file systems); other failures raise OSError (FileExistsError for NOREPLACE)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.renameat2
    except (OSError, AttributeError):
        return False
    call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if call(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(dst))


def _lock(path: Path, wait: bool):
    """An open file holding an exclusive flock on `path` (created if missing), or None when another process holds it
    and `wait` is False. The lock is taken again when `path` was removed or replaced meanwhile (a finished run, or
    `remove_stale`, unlinks it), so two holders never lock two different files of one name."""
    import fcntl  # platform: fcntl exists on POSIX systems only, and fsio must import everywhere

    while True:
        handle = open(path, "a")  # noqa: SIM115 - returned to the caller, who closes it
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            handle.close()
            return None
        try:
            same = os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return handle
        handle.close()


@contextlib.contextmanager
def _publish_lock(target: Path):
    """Where renameat2 is missing: an exclusive lock beside `target`, held from the existence check to the rename,
    so two headlab runs cannot both publish (other programs are not bound by it)."""
    lock = target.parent / f".{target.name}{_LOCK_SUFFIX}"
    handle = _lock(lock, wait=True)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        handle.close()


# ---- temporary names that say whose they are, and removing those of dead runs ----------------------------------

TMP_SUFFIX = ".headlab-tmp"  # every temporary file or folder headlab makes beside an output: .NAME.PID.HOST.xxxx + this


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname()) or "host"


def _tmp_prefix(target: Path) -> str:
    """`.NAME.PID.HOST.`: the temporary's owner, so that a later run can tell a dead run's leftover from a live one's
    (tempfile appends random letters, digits and _, then TMP_SUFFIX)."""
    return f".{target.name}.{os.getpid()}.{_host()}."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's live process
        return True
    return True


def remove_stale(folder: Path) -> list[Path]:
    """Remove what killed headlab runs left in `folder` (SIGKILL, power loss: no handler ran): temporary files and
    folders whose owner process, recorded in the name, is gone on this host, and lock files nobody holds. A
    temporary of a live process, of another host (a shared file system) or of unknown origin is kept. Returns what
    was removed. Visible `NAME.partial` folders are kept: they hold a resumable run's completed steps."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    host = _host()
    for entry in entries:
        name = entry.name
        if not name.startswith("."):
            continue
        path = Path(entry.path)
        if name.endswith(TMP_SUFFIX):
            parts = name[1 : -len(TMP_SUFFIX)].rsplit(".", 3)  # NAME, PID, HOST, random
            if len(parts) != 4 or not parts[1].isdigit() or parts[2] != host or _alive(int(parts[1])):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
        elif name.endswith(_LOCK_SUFFIX) and entry.is_file(follow_symlinks=False):
            try:
                handle = _lock(path, wait=False)
            except OSError:
                continue
            if handle is not None:  # nobody holds it: a leftover
                path.unlink(missing_ok=True)
                handle.close()
                removed.append(path)
    return removed


def _unrenameable(target: Path, kind: str) -> str | None:
    """Why an existing `target` cannot be swapped for a new `kind` ("folder" or "file") output by a rename at all,
    whatever the caller allows: a mount point (EBUSY), a FIFO, device or socket, or the other kind of entry."""
    try:
        info = os.stat(target)
    except OSError:
        return None  # absent, or a dangling link
    if os.path.ismount(real(target)):
        return "is a mount point"
    wanted = stat.S_ISDIR if kind == "folder" else stat.S_ISREG
    if not wanted(info.st_mode):
        return f"is not a {kind} ({replace_refusal(target) or 'another kind of entry'})"
    return None


def _umask() -> int:
    """The process umask, read without changing it where /proc says it (os.umask can only set and return)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(root: Path) -> None:
    """Give a finished temporary tree the permissions a plain mkdir/open would have (mkdtemp makes 0700 and
    safetensors 0600): directories 0777 & ~umask, files 0666 & ~umask."""
    mask = _umask()
    os.chmod(root, 0o777 & ~mask)
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(folder, name), 0o777 & ~mask)
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def _keep(tmp: Path, target: Path) -> Path:
    """Rename a finished result that could not be published to a visible sibling of `target`, and return it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for attempt in range(100):
        kept = target.with_name(f"{target.name}.unpublished-{stamp}-{os.getpid()}{f'-{attempt}' if attempt else ''}")
        if not os.path.lexists(kept):
            os.rename(tmp, kept)
            return kept
    return tmp


def publish(tmp: Path, target: Path, overwrite: bool, replaceable=None) -> None:
    """Move the finished `tmp` to `target` without ever replacing what it did not expect.

    - target absent: renameat2(RENAME_NOREPLACE), so an output that appeared meanwhile is never replaced;
    - target present (appeared meanwhile) without `overwrite` (or `replaceable(target)`): the result is kept in a
      visible sibling `TARGET.unpublished-STAMP-PID`, which the one-line error names; nothing is replaced;
    - target present with `overwrite`: renameat2(RENAME_EXCHANGE) swaps old and new atomically, then the old is
      deleted, so readers see the old or the new, never neither.
    Without renameat2 the same steps run under an exclusive lock file beside `target` (headlab runs only).
    """
    try:
        if _renameat2(tmp, target, _RENAME_NOREPLACE):
            return
    except FileExistsError:
        _publish_existing(tmp, target, overwrite, replaceable)
        return
    with _publish_lock(target):  # fallback: no atomic no-replace rename here
        if not os.path.lexists(target):
            os.rename(tmp, target)
            return
        _publish_existing(tmp, target, overwrite, replaceable)


def _publish_existing(tmp: Path, target: Path, overwrite: bool, replaceable) -> None:
    if not (overwrite or (replaceable is not None and replaceable(target))):
        kept = _keep(tmp, target)
        raise HeadlabError(
            f"{target} appeared while this command ran (another run writing there?) and was not replaced; the "
            f"finished result is in {kept}: move it into place, or rerun with overwrite=True"
        )
    problem = _unrenameable(target, "folder" if tmp.is_dir() else "file")
    if problem is not None:  # what is there now (it may have changed since the start) cannot be swapped
        kept = _keep(tmp, target)
        raise HeadlabError(f"{target} {problem} and was not replaced; the finished result is in {kept}")
    if _renameat2(tmp, target, _RENAME_EXCHANGE):  # `tmp` now holds the old output
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink()
        return
    old = Path(tempfile.mkdtemp(prefix=_tmp_prefix(target), suffix=TMP_SUFFIX, dir=target.parent))
    os.replace(target, old / target.name)
    try:
        os.rename(tmp, target)
    except OSError:
        os.replace(old / target.name, target)  # put the old output back
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


_WRITE_ERRORS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                 errno.EROFS: "read-only file system", errno.EACCES: "permission denied", errno.EIO: "I/O error"}  # fmt: skip


def _write_failure(error: BaseException) -> str | None:
    """Why writing failed, for the environment's failures (full disk, quota, permissions); None for anything else.
    safetensors reports a full disk as SafetensorError("... No space left on device (os error 28)")."""
    if isinstance(error, OSError) and error.errno in _WRITE_ERRORS:
        return _WRITE_ERRORS[error.errno]
    text = str(error)
    if type(error).__name__ == "SafetensorError" and any(
        sign in text for sign in ("os error 28", "code: 28", "StorageFull", "No space left on device")
    ):
        return _WRITE_ERRORS[errno.ENOSPC]
    return None


def _check_existing(target: Path, overwrite: bool, replaceable, kind: str) -> None:
    """An existing `target` needs overwrite (or `replaceable(target)`), and must be something a rename can swap."""
    if not os.path.lexists(target):
        return
    if not overwrite and not (replaceable and replaceable(target)):
        raise HeadlabError(f"{target} already exists; pass overwrite=True to replace it")
    problem = _unrenameable(target, kind)
    if problem is not None:
        raise HeadlabError(f"{target} {problem}; it cannot be replaced: move it away or choose another")


@contextlib.contextmanager
def atomic_directory(target: Path, overwrite: bool = False, replaceable=None):
    """Yield a temporary directory beside `target` and publish it (see `publish`) only if the block succeeds.

    An existing target is replaced only with overwrite=True (or when `replaceable(target)` says so), and only after
    the new content is complete; the result gets the umask's permissions. If the block fails because the disk is
    full (or another write error of the environment), the temporary directory is removed, the previous output is
    untouched, and the error is one line.
    """
    target = Path(target)
    if _relation(real(target), real(Path.cwd())) in ("is", "contains"):  # renaming it would fail with EBUSY
        raise HeadlabError(f"{target} is the working directory or holds it; name a new directory")
    _check_existing(target, overwrite, replaceable, "folder")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(target.parent)
        tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(target), suffix=TMP_SUFFIX, dir=target.parent))
    except OSError as error:
        raise HeadlabError(f"cannot create {target}: {_write_failure(error) or error.strerror}") from None
    try:
        yield tmp
        apply_umask(tmp)
        publish(tmp, target, overwrite, replaceable)
    except BaseException as error:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        reason = _write_failure(error)
        if reason is not None:
            state = "the previous output is untouched" if os.path.lexists(target) else "nothing was written"
            raise HeadlabError(f"writing {target} failed: {reason}; {state}") from None
        raise


def atomic_write_text(path: Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file beside it and a rename, so readers never see half a file."""
    return atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, content: bytes) -> Path:
    """Write `content` to `path` through a temporary file beside it and a rename, so readers never see half a file:
    on a full disk the previous file stays whole (one-line error). The file gets the umask's permissions."""
    path = Path(path)
    problem = _unrenameable(path, "file")
    if problem is not None:  # renaming onto a folder fails; onto a FIFO or device it would delete the user's entry
        raise HeadlabError(f"cannot write {path}: it {problem}; move it away or choose another")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(path.parent)
        fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(path), suffix=TMP_SUFFIX, dir=path.parent)
    except OSError as error:
        raise HeadlabError(f"cannot write {path}: {_write_failure(error) or error.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(content)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException as error:
        Path(tmp).unlink(missing_ok=True)
        reason = _write_failure(error)
        if reason is not None:
            state = "the previous file is untouched" if path.exists() else "nothing was written"
            raise HeadlabError(f"writing {path} failed: {reason}; {state}") from None
        raise
    return path


def json_text(payload) -> str:
    """The one JSON layout of every file headlab writes: indented, non-JSON values as str, a final newline."""
    return json.dumps(payload, indent=2, default=str) + "\n"


def write_json(path: Path, payload: dict) -> None:
    """Write `payload` as JSON (see json_text) into a file that is itself inside an atomic directory or new."""
    Path(path).write_text(json_text(payload))


# ---- resumable multi-step outputs ------------------------------------------------------------------------------

PARTIAL_SUFFIX = ".partial"
_JOURNAL = "journal.json"


class StepJournal:
    """The completed steps of a multi-step run, kept in its staging directory (`TARGET.partial/journal.json`) with the
    key (inputs and options) they were computed for. A rerun with the same key finds them and skips them."""

    def __init__(self, staging: Path, key: dict):
        self.staging, self.key = staging, key
        self.completed: list[str] = []
        self.records: dict[str, dict] = {}  # what each completed step recorded (finish's `record`)
        self.resumed: list[str] = []  # the steps found complete when the run began

    def done(self, step: str) -> bool:
        return step in self.completed

    def finish(self, step: str, record: dict | None = None) -> None:
        """Record `step` as complete, with a small JSON `record` of it (atomically: a kill leaves the journal as it
        was or with the step added)."""
        self.completed.append(step)
        self.records[step] = record or {}
        self._save()

    def _save(self) -> None:
        payload = {"key": self.key, "completed": self.completed, "records": self.records}
        atomic_write_text(self.staging / _JOURNAL, json_text(payload))

    def _load(self) -> bool | None:
        """Read a previous run's journal: True when it was made for the same key, False for another key, None when
        `staging` holds no headlab journal (then it is not a headlab staging directory)."""
        try:
            saved = json.loads((self.staging / _JOURNAL).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(saved, dict) or "key" not in saved:
            return None
        if saved.get("key") != json.loads(json_text(self.key)):
            return False
        self.completed = [str(step) for step in saved.get("completed", [])]
        self.records = {step: saved.get("records", {}).get(step, {}) for step in self.completed}
        self.resumed = list(self.completed)
        return True


def partial_path(target: Path) -> Path:
    """Where a resumable run of `target` keeps its completed steps until it is published: `TARGET.partial`."""
    target = Path(target)
    return target.with_name(target.name + PARTIAL_SUFFIX)


@contextlib.contextmanager
def resumable_directory(target: Path, key: dict, overwrite: bool = False, replaceable=None):
    """Like atomic_directory, for a run made of steps: yields a StepJournal whose `staging` directory
    (`TARGET.partial`, beside `target`) keeps each completed step when a later one fails or the run is interrupted,
    so a rerun with the same key (inputs and options, compared as JSON, and headlab's version) resumes after the last
    completed step. A
    staging directory made for another key is started afresh, and one where no step completed is removed on failure
    (a refused run writes nothing). The finished run is published like atomic_directory's (never replacing what it
    did not expect) and the journal is not part of it."""
    target = Path(target)
    if _relation(real(target), real(Path.cwd())) in ("is", "contains"):  # renaming it would fail with EBUSY
        raise HeadlabError(f"{target} is the working directory or holds it; name a new directory")
    _check_existing(target, overwrite, replaceable, "folder")
    staging = partial_path(target)
    with _staging_lock(target, staging):
        journal = _open_journal(staging, {**key, "headlab": __version__})  # another version: start afresh
        try:
            yield journal
        except BaseException as error:
            if not journal.completed:  # nothing worth keeping: the run leaves nothing behind
                shutil.rmtree(staging, ignore_errors=True)
            if not isinstance(error, HeadlabError) or not journal.completed or str(staging) in str(error):
                raise  # (the caller already said what was kept)
            raise HeadlabError(
                f"{error}; the completed steps ({', '.join(journal.completed)}) are kept in {staging}: rerun the "
                "same command to resume"
            ) from error
        (staging / _JOURNAL).unlink(missing_ok=True)
        apply_umask(staging)
        publish(staging, target, overwrite, replaceable)


@contextlib.contextmanager
def _staging_lock(target: Path, staging: Path):
    """An exclusive lock beside `staging` for the whole run: a second run writing the same output is refused."""
    with _writer_lock(target, f".{staging.name}{_LOCK_SUFFIX}", f" (it holds {staging})"):
        yield


@contextlib.contextmanager
def _writer_lock(target: Path, name: str, holding: str = ""):
    """An exclusive lock file `name` beside `target` for a whole run: a second run writing the same output is refused
    in one line. Leftovers of killed runs beside `target` are removed first (`remove_stale`)."""
    path = target.parent / name
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(target.parent)
        handle = _lock(path, wait=False)
    except OSError as error:
        raise HeadlabError(f"cannot create {target}: {_write_failure(error) or error.strerror}") from None
    if handle is None:  # the other run's lock file stays
        raise HeadlabError(f"another headlab run is writing {target}{holding}; wait for it")
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        handle.close()


@contextlib.contextmanager
def atomic_file(target: Path, overwrite: bool = False, replaceable=None):
    """Yield a temporary file path beside `target` and publish it (see `publish`) only if the block succeeds: one
    output file, written all or nothing, with the umask's permissions. For the whole block a lock file beside it
    (`.NAME.writer.headlab-lock`) refuses a second headlab run writing the same file, so two runs never both report
    success for one file. An existing target needs overwrite and must be a file headlab may replace
    (`check_replaceable`). A write failure of the environment (full disk, read-only file system) removes the
    temporary file and is one line; the previous file is untouched."""
    target = Path(target)
    if os.path.lexists(target) and not overwrite and not (replaceable and replaceable(target)):
        raise HeadlabError(f"{target} already exists; pass overwrite=True to replace it")
    if os.path.lexists(target) and not (replaceable and replaceable(target)):
        check_replaceable(target)
    with _writer_lock(target, f".{target.name}.writer{_LOCK_SUFFIX}"):
        try:
            handle, name = tempfile.mkstemp(prefix=_tmp_prefix(target), suffix=TMP_SUFFIX, dir=target.parent)
            os.close(handle)
        except OSError as error:
            raise HeadlabError(f"cannot write {target}: {_write_failure(error) or error.strerror}") from None
        tmp = Path(name)
        try:
            yield tmp
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600
            publish(tmp, target, overwrite, replaceable)
        except BaseException as error:
            tmp.unlink(missing_ok=True)
            reason = _write_failure(error)
            if reason is not None:
                state = "the previous file is untouched" if os.path.lexists(target) else "nothing was written"
                raise HeadlabError(f"writing {target} failed: {reason}; {state}") from None
            raise


@contextlib.contextmanager
def scratch_file(target: Path):
    """Yield a temporary file path beside `target` (an intermediate that is never published, such as the f32 file
    export-gguf hands to llama.cpp's quantizer), removed when the block ends however it ends. Named like every
    headlab temporary (.NAME.PID.HOST.xxxx.headlab-tmp), so a killed run's leftover is removed by `remove_stale`."""
    target = Path(target)
    try:
        handle, name = tempfile.mkstemp(prefix=_tmp_prefix(target), suffix=TMP_SUFFIX, dir=target.parent)
        os.close(handle)
    except OSError as error:
        raise HeadlabError(f"cannot write beside {target}: {_write_failure(error) or error.strerror}") from None
    try:
        yield Path(name)
    finally:
        Path(name).unlink(missing_ok=True)


def _open_journal(staging: Path, key: dict) -> StepJournal:
    """The journal of `staging`: an earlier run's for the same key (resumed), or a new one (an earlier run's
    directory for another key is removed first). Refuses a `staging` that headlab did not make."""
    journal = StepJournal(staging, key)
    if os.path.lexists(staging):
        found = journal._load() if staging.is_dir() and not staging.is_symlink() else None
        if found is None:  # never remove what headlab did not make
            raise HeadlabError(
                f"{staging} exists and is not a headlab run's staging directory (no journal.json); move it away"
            )
        if found is False:
            shutil.rmtree(staging)  # an earlier run's steps, for other inputs or options
    try:
        staging.mkdir(exist_ok=True)
        if not journal.resumed:
            journal._save()  # the mark of a headlab staging directory, from its first moment
    except OSError as error:
        raise HeadlabError(f"cannot create {staging}: {_write_failure(error) or error.strerror}") from None
    return journal
