// Internal view of a group (see engine.h).
#ifndef JTILERT_GROUP_H_
#define JTILERT_GROUP_H_

#include "common.cuh"

namespace jt {

struct Group {
  int world;
  int devices[JT_MAX_WORLD];
  long long cap_lines;   // payload capacity per (parity, stage, source), lines
  long long timeout_ns;  // spin-wait limit
  uint4* inbox[JT_MAX_WORLD];         // [2 parity][2 stage][world][cap_lines]
  unsigned int* ctrs[JT_MAX_WORLD];   // [0] epoch, [1] done
  JtStatus* status;                   // host-mapped, [world]
};

// nullptr if gid is not a created group.
const Group* get_group(int gid);
// Fills the kernel-side parameters of rank `rank` of group `gid`.
bool make_comm(int gid, int rank, CommParams* c);

}  // namespace jt

#endif  // JTILERT_GROUP_H_
