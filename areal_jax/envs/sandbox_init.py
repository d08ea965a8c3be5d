"""The first program of a sandboxed run: sets the child up, then replaces itself by the user's code.

Run by ``python_sandbox.Sandbox`` as ``python -I -S sandbox_init.py SPEC`` (stdlib only, nothing of
areal_jax imported), inside fresh namespaces made by ``unshare`` (network, mount, PID; a user
namespace too when not started as root) where the sandbox has them. In that case it, as root of
those namespaces:

1. hides every top-level directory but the system's (``KEEP``: /usr, /etc, /dev, /lib, ...) under
   an empty tmpfs (/home, /root, /var, /opt, /sys, the project's directory, ...), and binds the
   Python interpreter's own directory back at its path if it was under one of them;
2. makes every mount read-only and nosuid (``mount_setattr`` with ``AT_RECURSIVE``, Linux >= 5.12);
3. mounts fresh, size-limited tmpfs on ``/tmp`` and ``/dev/shm``, the only writable places; the
   program runs in ``/tmp/work`` with ``main.py`` in it;
4. (in the program's process) if started as real root, switches to the run's own unprivileged
   uid and gid (so that RLIMIT_NPROC counts, and file permissions hold, for that uid alone); if
   not, moves into a nested user namespace as a non-root uid, without capabilities.

Then it forks: it stays as the supervisor (the PID namespace's init), waits for the program and
exits with its status (killed by signal ``s``: ``128 + s``). The child, in every mode: no new
privileges (PR_SET_NO_NEW_PRIVS), killed if the supervisor dies (PR_SET_PDEATHSIG), the resource
limits, a minimal environment, and ``execve`` of the interpreter on ``main.py`` (``-I -S -B``:
isolated, no site-packages, no bytecode files). A setup failure exits with ``SETUP_FAILED`` and
says why on stderr: the sandbox never runs code half set up.
"""

import ctypes
import json
import os
import resource
import signal
import sys

SETUP_FAILED = 125

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 4096, 16384, 1 << 18
AT_RECURSIVE, MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x8000, 1, 2
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (new syscall table)
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
AT_FDCWD = -100
CLONE_NEWUSER = 0x10000000
INNER_UID = 1000  # the program's uid and gid when not started as root (in its own user namespace)
# Top-level directories the program sees (read-only); every other one is an empty tmpfs to it.
KEEP = ("bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
  if ret != 0:
    e = ctypes.get_errno()
    raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(source, target, fstype, flags, data=None):
  enc = lambda s: None if s is None else s.encode()
  _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
         f"mount {target}")


class _MountAttr(ctypes.Structure):
  _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
              ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _mount_setattr(path, flags, attr_set, attr_clr):
  attr = _MountAttr(attr_set, attr_clr, 0, 0)
  _check(_libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), path.encode(),
                       ctypes.c_uint(flags), ctypes.byref(attr),
                       ctypes.c_size_t(ctypes.sizeof(attr))), f"mount_setattr {path}")


def _read_only_everywhere():
  """Every mount read-only and nosuid, but the namespace's own /proc (the program's process
  writes its user namespace's maps there; what /proc lets a process write is its own)."""
  _mount_setattr("/", AT_RECURSIVE, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0)
  _mount_setattr("/proc", 0, 0, MOUNT_ATTR_RDONLY)


def _hide_all_but_system(python_home):
  """Covers every top-level directory but the system's (``KEEP``) with an empty tmpfs, then binds
  the interpreter's directory back at its own path if it was under one of them."""
  fd = os.open(python_home, os.O_PATH | os.O_DIRECTORY)
  try:
    hidden = []
    for name in sorted(os.listdir("/")):
      path = "/" + name
      if name in KEEP or os.path.islink(path) or not os.path.isdir(path):
        continue
      _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=64k")
      hidden.append(path)
    if any(python_home.startswith(h + "/") for h in hidden):
      os.makedirs(python_home, exist_ok=True)
      _mount(f"/proc/self/fd/{fd}", python_home, None, MS_BIND | MS_REC)
  finally:
    os.close(fd)


def _setup_namespaces(spec, code):
  _mount(None, "/", None, MS_REC | MS_PRIVATE)
  _hide_all_but_system(spec["python_home"])
  _read_only_everywhere()
  size = f"size={int(spec['limits']['max_file_mib'])}m"
  for place in ("/tmp", "/dev/shm"):
    if os.path.isdir(place):
      _mount("tmpfs", place, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,{size}")
  work = "/tmp/work"
  os.mkdir(work, 0o700)
  with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
    f.write(code)
  return work


def _drop_privileges(uid):
  for path in (os.getcwd(), os.path.join(os.getcwd(), "main.py")):
    os.chown(path, uid, uid)
  os.setgroups([])
  os.setgid(uid)
  os.setuid(uid)


def _leave_the_user_namespace():
  """Started by a non-root user, this process is root of the user namespace that owns its mount
  namespace, and could undo the mounts. It moves into a user namespace of its own as uid
  ``INNER_UID``: the program then has no capability (it is not root there), and none over the
  mount namespace (owned by the parent user namespace), whose mounts it can neither change nor
  unmount."""
  _check(_libc.unshare(ctypes.c_int(CLONE_NEWUSER)), "unshare user namespace")
  for name, text in (("setgroups", "deny"), ("uid_map", f"{INNER_UID} 0 1"),
                     ("gid_map", f"{INNER_UID} 0 1")):
    with open(f"/proc/self/{name}", "w", encoding="ascii") as f:
      f.write(text)


def _limit(spec):
  lim = spec["limits"]
  mib = 1 << 20
  for res, value in ((resource.RLIMIT_CPU, max(1, int(lim["cpu_s"]))),
                     (resource.RLIMIT_AS, int(lim["memory_mib"]) * mib),
                     (resource.RLIMIT_NPROC, int(lim["max_processes"])),
                     (resource.RLIMIT_FSIZE, int(lim["max_file_mib"]) * mib),
                     (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(res, (value, value))


def _fail(e):
  print(f"sandbox setup failed: {e}", file=sys.stderr, flush=True)
  os._exit(SETUP_FAILED)


def _supervise(child):
  """Waits for the program's process (reaping any other that ends meanwhile, as the PID
  namespace's init) and exits with its status, a signal ``s`` as ``128 + s``."""
  while True:
    try:
      pid, status = os.wait()
    except ChildProcessError:
      os._exit(SETUP_FAILED)
    if pid == child:
      os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def main():
  with open(sys.argv[1], encoding="utf-8") as f:
    spec = json.load(f)
  with open(os.path.join(os.path.dirname(sys.argv[1]), "main.py"), encoding="utf-8") as f:
    code = f.read()
  try:
    if spec["namespaces"]:
      work = _setup_namespaces(spec, code)
    else:
      work = os.path.dirname(os.path.abspath(sys.argv[1]))
  except Exception as e:  # noqa: BLE001 - any failure: refuse to run the code, say why
    _fail(e)
  # This process stays as the supervisor (in a PID namespace its init, which the program cannot
  # signal); the program runs in a child, so its death by a signal is seen and reported.
  child = os.fork()
  if child:
    _supervise(child)
  try:
    os.chdir(work)
    if spec["uid"] is not None:
      _drop_privileges(spec["uid"])
    elif spec["namespaces"]:
      _leave_the_user_namespace()
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl no_new_privs")
    _check(_libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0), "prctl pdeathsig")
    _limit(spec)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8"}
    python = spec["python"]
    os.execve(python, [python, "-I", "-S", "-B", "main.py"], env)
  except Exception as e:  # noqa: BLE001
    _fail(e)


if __name__ == "__main__":
  main()
