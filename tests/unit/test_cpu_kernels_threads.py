"""The compiled CPU codec when its worker threads cannot start (``pthread_create`` failing with
EAGAIN, as under a process or cgroup thread limit): the kernel finishes on the calling thread
with the bits of a one-thread run. Before, ``std::thread``'s exception left ``parallel_for``
with joinable threads (or crossed ctypes' C frames): ``std::terminate``, the process aborted.

The failure is injected by a ``pthread_create`` shim loaded with ``LD_PRELOAD`` in a child
process (its ``shim_fail_after(n)`` lets ``n`` more threads start, then fails every call)."""

import os
import shutil
import subprocess
import sys

import pytest

from compressors import cpu_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHIM = r"""
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
static int fail_after = -1;  // threads still let through before every call fails; -1: never fail
extern "C" void shim_fail_after(int n) { fail_after = n; }
extern "C" int pthread_create(pthread_t* t, const pthread_attr_t* a, void* (*f)(void*), void* arg) {
  using fn = int (*)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
  static fn real = (fn)dlsym(RTLD_NEXT, "pthread_create");
  if (fail_after == 0) return EAGAIN;
  if (fail_after > 0) --fail_after;
  return real(t, a, f, arg);
}
"""

CHILD = r"""
import ctypes, sys
import torch
from compressors import cpu_kernels as ck
shim = ctypes.CDLL(sys.argv[1])
lib = ck.lib(torch.zeros(1))
assert lib is not None, ck.build_error()
chunk, n = 128, 128 * 64  # 64 units of 128 elements: 4 threads get 16 each
g = torch.Generator().manual_seed(0)
s = torch.randn(n // chunk, generator=g)
packed = torch.randint(0, 256, (n // 8,), dtype=torch.uint8, generator=g)
x = torch.randn(n, generator=g)

def decode(nth):
    out = torch.empty(n)
    lib.cp_sign_decode(s.data_ptr(), packed.data_ptr(), n, chunk, out.data_ptr(), 0, nth)
    return out

def encode(nth):  # qsgd 4 bits: per-chunk scales and packed codes
    sc, q = torch.empty(n // chunk), torch.zeros(n // 2, dtype=torch.uint8)
    lib.cp_qsgd_encode(x.data_ptr(), 0, n, chunk, 4, 12345, sc.data_ptr(), q.data_ptr(), nth)
    return torch.cat([sc.view(torch.uint8), q])

ref_d, ref_e = decode(1), encode(1)
for started in (1, 0):  # one worker starts and two fail; none starts
    shim.shim_fail_after(started)
    d, e = decode(4), encode(4)
    shim.shim_fail_after(-1)
    assert torch.equal(d.view(torch.int32), ref_d.view(torch.int32)), started
    assert torch.equal(e, ref_e), started
print("ok")
"""


def test_kernels_finish_on_the_caller_when_threads_cannot_start(tmp_path):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None or cpu_kernels.lib() is None:
        pytest.skip("no C++ compiler or no compiled codec: the torch path has no threads of its own")
    src, so = tmp_path / "shim.cpp", tmp_path / "libshim.so"
    src.write_text(SHIM)
    subprocess.run([cxx, "-O1", "-shared", "-fPIC", str(src), "-o", str(so), "-ldl"], check=True,
                   capture_output=True, timeout=120)
    env = dict(os.environ, LD_PRELOAD=str(so), PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", CHILD, str(so)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
