// Entry points of a shared library opened at run time with dlopen() and never linked (the
// CUDA driver, libcurl), so that one build of pyloader runs with and without it.
#pragma once

#include <dlfcn.h>

#include <string>

namespace pyloader {

// Resolves a library's symbols one by one: `resolve("name", &fn)` is false once a symbol is
// missing, with "<library> has no symbol <name><hint>" in *why.
class SymbolResolver {
 public:
  SymbolResolver(void* lib, const char* library, std::string* why, const char* hint = "")
      : lib_(lib), library_(library), why_(why), hint_(hint) {}

  template <typename Fn>
  bool operator()(const char* name, Fn* out) const {
    void* p = ::dlsym(lib_, name);
    if (!p) {
      *why_ = std::string(library_) + " has no symbol " + name + hint_;
      return false;
    }
    *out = reinterpret_cast<Fn>(p);
    return true;
  }

 private:
  void* lib_;
  const char* library_;
  std::string* why_;
  const char* hint_;
};

}  // namespace pyloader
