// Exercises the NCCL device API through deep_ep's NVRTC compatibility layer:
// LSA pointer, LSA barrier, GIN put with a signal, GIN flush, signal wait.
#include <nccl_device.h>

extern "C" __global__ void nccl_device_api_probe(ncclDevComm comm, ncclWindow_t win, size_t bytes, int* out) {
  // LSA: write into the peer's copy of the symmetric window.
  const int peer = (comm.lsaRank + 1) % comm.lsaSize;
  int* remote = static_cast<int*>(ncclGetLsaPointer(win, 0, peer));
  remote[threadIdx.x] = comm.rank;

  // LSA barrier across the team, one CTA-wide session per block.
  {
    ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), comm, ncclTeamTagLsa(), blockIdx.x);
    bar.sync(ncclCoopCta(), cuda::memory_order_seq_cst);
  }

  // GIN: put `bytes` to the next world rank with a signal increment, then flush.
  ncclGin gin(comm, /*contextIndex=*/0);
  const int world_peer = (comm.rank + 1) % comm.nRanks;
  if (threadIdx.x == 0) {
    gin.put(ncclTeamWorld(comm), world_peer, win, bytes, win, 0, bytes, ncclGin_SignalInc{0});
    gin.put(ncclTeamWorld(comm), world_peer, win, 2 * bytes, win, 0, bytes, ncclGin_SignalAdd{1, 2});
  }
  gin.flush(ncclCoopCta());
  gin.waitSignal(ncclCoopCta(), /*signal=*/0, /*least=*/1);
  if (threadIdx.x == 0) out[blockIdx.x] = static_cast<int>(gin.readSignal(0));
}
