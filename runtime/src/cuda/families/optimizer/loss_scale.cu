// loss_scale.cu: the dynamic loss scaler's state update and the optimizer step counter, on
// the device (single-thread kernels: no host synchronization per step, graph-capturable).
//
//   loss_scale_update(scale_in, counters_in, grad_norm, scale_out, counters_out,
//                     growth_factor, backoff_factor, growth_interval, hysteresis, max_scale)
//     scale: F32 scalar; counters: F32[2] = (clean steps since the last change, overflows
//     still tolerated); grad_norm: F32 scalar, not finite = found_inf. In and out may alias.
//     torch.amp.GradScaler with DeepSpeed's hysteresis (DynamicLossScaler):
//       overflow:  tolerated <= 1 -> scale *= backoff_factor (0.5), counters = (0, tolerated)
//                  otherwise      -> scale unchanged,            counters = (0, tolerated - 1)
//       clean, clean + 1 >= growth_interval (2000):
//                  scale = min(scale * growth_factor (2.0), max(max_scale (2^24), scale)),
//                  counters = (0, hysteresis)    (the tolerance refills on growth)
//       clean, otherwise: counters = (clean + 1, tolerated)
//     With hysteresis 1 this is GradScaler exactly. The products are formed in F64 and rounded
//     to F32, as the CPU twin (runtime/src/cpu/optimizer.rs loss_scale_update).
//   count_step(step_in, grad_norm, step_out): step_out = step_in + 1 when grad_norm is finite
//     (the step was taken), else step_in. Launch after every optimizer kernel of the step.
// Launch: <<<1, 1>>> (any launch works: only thread 0 of block 0 acts).
#include "castor_common.cuh"

extern "C" __global__ void loss_scale_update(const float* scale_in, const float* counters_in,
                                             const float* grad_norm, float* scale_out,
                                             float* counters_out, double growth_factor,
                                             double backoff_factor, i64 growth_interval,
                                             i64 hysteresis, double max_scale) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const float scale = *scale_in;
    const float clean = counters_in[0], tolerated = counters_in[1];
    float s = scale, c0, c1;
    if (!isfinite(*grad_norm)) {
        c0 = 0.0f;
        if (tolerated <= 1.0f) {
            s = float(double(scale) * backoff_factor);
            c1 = tolerated;
        } else {
            c1 = tolerated - 1.0f;
        }
    } else if (clean + 1.0f >= float(growth_interval)) {
        const double grown = double(scale) * growth_factor;
        const double cap = fmax(max_scale, double(scale));
        s = float(fmin(grown, cap));
        c0 = 0.0f;
        c1 = float(hysteresis);
    } else {
        c0 = clean + 1.0f;
        c1 = tolerated;
    }
    *scale_out = s;
    counters_out[0] = c0;
    counters_out[1] = c1;
}

extern "C" __global__ void count_step(const float* step_in, const float* grad_norm,
                                      float* step_out) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const float step = *step_in;
    *step_out = isfinite(*grad_norm) ? step + 1.0f : step;
}
