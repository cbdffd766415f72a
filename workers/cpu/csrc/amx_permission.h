// The AMX tile state of this process, asked for once (amx_linear.cpp, prefill_attention.cpp and
// peak_probe.cpp all use tiles). Linux gives a process the tile state only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); without it the first tile instruction kills the
// process with SIGILL. oneDNN asks the same way; asking twice is harmless. Include only from code
// compiled with AMX enabled (the "amx" variant).

#pragma once

#include <sys/syscall.h>
#include <unistd.h>

namespace tpserve {

// True once the OS granted this process the tile state (asked on the first call).
inline bool amx_usable() {
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

}  // namespace tpserve
