// A call from a compiled XLA:CPU program back into Python, through XLA's FFI
// (jaxspec/native/host_call.py).
//
// jax.pure_callback does the same, but a program holding one is never written to JAX's persistent
// compilation cache (its callback is a Python object inside the executable), so a server compiled
// its constrained-decoding programs again at every start. This handler holds no Python object: the
// program names the Python function by an integer attribute, `fn`, and the handler hands that id
// and the addresses of every argument and result buffer to one function pointer that Python sets
// at start-up (`JaxspecSetHostCall`). Python looks the id up, views the buffers as numpy arrays,
// runs the function and writes the results in place.
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

extern "C" {
// fn id, number of buffers, their addresses (arguments, then results); returns 0 on success
typedef int32_t (*JaxspecHostFn)(int64_t, int64_t, void**);
}

namespace {

JaxspecHostFn g_host_fn = nullptr;

ffi::Error HostCallImpl(int64_t fn, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (g_host_fn == nullptr) return ffi::Error::Internal("host_call: no Python function is set");
  std::vector<void*> ptrs;
  ptrs.reserve(args.size() + rets.size());
  for (size_t i = 0; i < args.size(); ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    ptrs.push_back(b->untyped_data());
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    ptrs.push_back((*b)->untyped_data());
  }
  if (g_host_fn(fn, int64_t(ptrs.size()), ptrs.data()) != 0)
    return ffi::Error::Internal("host_call: the Python function failed (see the log)");
  return ffi::Error::Success();
}

}  // namespace

extern "C" void JaxspecSetHostCall(JaxspecHostFn fn) { g_host_fn = fn; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecHostCall, HostCallImpl,
                              ffi::Ffi::Bind().Attr<int64_t>("fn").RemainingArgs().RemainingRets());
