// kernels/internode/kernels.cuh - the high-throughput kernels across nodes
// (issue 25; docs/internode_ht.md "A first version"), templates over the
// device transport: libepx instantiates them for its transports
// (kernels/internode.cu), the NVSHMEM module for its own
// (transport/nvshmem/ht_kernels.cu). Each op is a barrier kernel, then three
// kernels; the launchers are launch_ht_net_dispatch_for / _combine_for.
// One file per kernel or role in this folder; this header includes them in order.
#pragma once

// The parts in the original order (each also includes the one before it).
// clang-format off
#include "kernels/internode/common.cuh"
#include "kernels/internode/node_put.cuh"
#include "kernels/internode/barrier.cuh"
#include "kernels/internode/dispatch.cuh"
#include "kernels/internode/ring_dispatch.cuh"
#include "kernels/internode/dispatch_launch.cuh"
#include "kernels/internode/combine.cuh"
#include "kernels/internode/ring_combine.cuh"
#include "kernels/internode/launch.cuh"
// clang-format on
