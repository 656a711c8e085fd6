//! The learning-rate schedule (MaxText's: linear warmup, then cosine decay to a floor) and
//! global-norm clipping's factor: what [`crate::Engine::update`] hands the optimizer besides the
//! gradients, the same whatever the optimizer.

use crate::config::TrainConfig;

/// Linear warmup to the peak over `warmup_steps_fraction · steps`, then cosine decay to
/// `learning_rate_final_fraction · peak` at the last step.
pub fn learning_rate(config: &TrainConfig, step: usize) -> f64 {
    let peak = config.learning_rate;
    let warmup = (config.warmup_steps_fraction * config.steps as f64).round() as usize;
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let span = (config.steps - warmup).max(1) as f64;
    let progress = ((step - warmup) as f64 / span).min(1.0);
    let floor = config.learning_rate_final_fraction * peak;
    floor
        + (peak - floor)
            * 0.5
            * (1.0 + ferrotext_tensor::fixed_math::cos_f64(std::f64::consts::PI * progress))
}

/// The scale that brings `norm` down to `threshold` (1 when under it, or when clipping is off).
pub fn clip_scale(norm: f64, threshold: f64) -> f64 {
    if threshold > 0.0 && norm > threshold {
        threshold / norm
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays_to_the_floor() {
        let c = TrainConfig {
            steps: 100,
            learning_rate: 1.0,
            warmup_steps_fraction: 0.1,
            learning_rate_final_fraction: 0.1,
            ..TrainConfig::default()
        };
        assert!((learning_rate(&c, 0) - 0.1).abs() < 1e-12);
        assert!((learning_rate(&c, 9) - 1.0).abs() < 1e-12);
        assert!((learning_rate(&c, 10) - 1.0).abs() < 1e-12);
        assert!((learning_rate(&c, 100) - 0.1).abs() < 1e-12);
        assert!(learning_rate(&c, 55) < 1.0 && learning_rate(&c, 55) > 0.1);
    }

    #[test]
    fn clipping_scales_only_a_norm_over_the_threshold() {
        assert_eq!(clip_scale(2.0, 1.0), 0.5);
        assert_eq!(clip_scale(0.5, 1.0), 1.0);
        assert_eq!(clip_scale(5.0, 0.0), 1.0);
    }
}
