// Test-only defects: the checks of this library must be able to fail.
#pragma once

namespace deep_ep {

// The checks of this library must be able to fail: the tests build the kernels with one deliberate
// defect at a time (EP_TEST_DEFECT, set only through DEEP_EP_TEST_DEFECT by tools/mutation_check.py)
// and expect the GPU suite and the bench's check to report it. 0, the default, builds no defect.
#ifndef EP_TEST_DEFECT
#define EP_TEST_DEFECT 0
#endif
constexpr int kDefectDroppedRow = 1;     // dropped row: dispatch leaves every output row with row % 64 == 63 unwritten
constexpr int kDefectWrongRow = 2;       // wrong row: dispatch writes rows with row % 61 == 7 to row ^ 1
constexpr int kDefectMissingBias = 3;    // missing bias: combine ignores bias 0
constexpr int kDefectScaledWeight = 4;   // scaled weight: dispatch doubles the received weight of top-k slot 0
constexpr int kDefectStaleScale = 5;     // stale scale factor: cached FP8 dispatch skips scale factors of rows with row % 8 == 3
constexpr int kDefectSkippedExpert = 6;  // skipped expert: expanded dispatch writes no rows for local expert 1

}  // namespace deep_ep
