// kernels/low_latency/kernels.cuh - low-latency dispatch and combine (decode).
// See docs/low_latency.md.
//
// Every op has a send phase and a receive phase, and one kernel (ops.cuh:
// ll::dispatch, ll::combine) whose launch runs either or both. With
// return_recv_hook the send is one launch and the hook launches the receive
// later, so nothing holds SMs in between; without, one launch runs both.
//
// Epochs: the send takes epoch = plan::next_epoch(*op_counter) (+ 1, never 0;
// the last block to finish stores it back), picks the half (epoch & 1) of the
// double buffer, and writes the epoch into the op's state word, from which a
// hook's receive kernel reads it. Nothing is reset between calls, so graph replays keep counting.
//
// Dispatch: one message per (token, destination rank) at slot [me][token] of
// the destination's receive area (FP8 quantized by the sender). Every
// 512-column chunk of a message is followed by a release-stored arrival flag
// (the epoch) for (me, token, chunk); token masks (one 32-token word per local
// expert) and token counts travel as epoch-tagged 64-bit words. The receiver
// waits for the masks, packs rows per local expert in the canonical order
// (source rank, then token), and copies each 2 KiB segment as soon as its
// chunks' flags are there. Without a hook, send and receive are one
// cooperative kernel whose first blocks send and the others receive.
//
// Combine: the expert rank sums the weighted outputs of a token's experts that
// it hosts and sends one row per (token, rank) back; a rank that hosts a
// single pick of the token sends the raw expert row (the source applies the
// weight, exactly). Weights travel from the source as epoch-tagged 64-bit
// words, one per (token, distinct expert), so they need no flag of their own.
// The last send block release-stores one flag per rank; without a hook each
// block then receives its items once every source's flag is in.
//
// Shrink mode (the transport's peer mask): nothing is stored to a masked rank
// and nothing is awaited from it; its picks count as masked (-1) and it
// counts as a source without tokens. A wait that passes its deadline masks
// its peer instead of failing the op (the transport does it).
//
// This folder holds the kernels and a launch helper per op for one transport
// type T (launch_*_for), one file per phase; this header includes them in
// order. low_latency.cu instantiates them for the built-in transports
// (dev::AnyTransport); a backend module with a transport of its own includes
// this header and instantiates them for that type (docs/nvshmem.md).
#pragma once

// The parts in the original order (each also includes the one before it).
// clang-format off
#include "kernels/low_latency/common.cuh"
#include "kernels/low_latency/dispatch_send.cuh"
#include "kernels/low_latency/dispatch_recv.cuh"
#include "kernels/low_latency/dispatch_recv_arrival.cuh"
#include "kernels/low_latency/dispatch_kernels.cuh"
#include "kernels/low_latency/combine_send.cuh"
#include "kernels/low_latency/combine_recv.cuh"
#include "kernels/low_latency/ops.cuh"
#include "kernels/low_latency/launch.cuh"
// clang-format on
