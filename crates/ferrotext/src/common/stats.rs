//! The one median every command reports timings with.
//!
//! (`ferrotext_cost` keeps its own, the mean of the two middle values of an even count;
//! the binary's reports have always taken the upper middle one, and keep doing so.)

/// The median of timings: the upper middle value of an even count (the middle one of an odd
/// count), 0 for none. NaNs sort above every number ([`f64::total_cmp`]).
pub fn median(mut xs: Vec<f64>) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn the_median_is_the_upper_middle_value_and_zero_for_none() {
        assert_eq!(median(Vec::new()), 0.0);
        assert_eq!(median(vec![3.0]), 3.0);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 3.0);
    }
}
