//! A tied table's two contributions into the sink's buffer with the handed path's bits (see the
//! module docs of `into`): the rows the lookup touches are set aside before the head's product
//! adds into the buffer, and added back once the table's cotangent is final.
//!
//! Invariant: between [`TiedRows::set_aside`] and [`TiedRows::add_back`], each touched row of the
//! buffer holds exactly the contributions to it (the head's widened product, then the lookup's
//! rows added into it, as the handed path sums them), because it started at `-0.0`, the one
//! value `x` with `x + y = y` for every `y` (`+0.0 + -0.0` is `+0.0`). Adding the saved row then
//! gives `acc + (w + rows)`, the handed path's sum.

use ferrotext_sharding::ArrayType;

use crate::ctx::Ctx;
use crate::error::SpmdError;
use crate::ids::Ids;

/// The rows of a tied table's buffer a lookup touches, with their values before the head's
/// product was added.
pub(super) struct TiedRows {
    /// Distinct local row indices, ascending.
    rows: Vec<usize>,
    /// Elements a row.
    width: usize,
    /// The rows' values, in `rows`' order.
    saved: Vec<f32>,
}

impl TiedRows {
    /// Saves the rows of `dest` (the table cotangent's local block, one part) that the take of
    /// `table` at `ids` touches, and sets them to `-0.0`; `None` (nothing touched) when the take
    /// could not add its rows into `dest` itself, so the pair is handed instead.
    ///
    /// # Errors
    /// A type the rules refuse.
    pub(super) fn set_aside(
        cx: &Ctx<'_>,
        (table, ids): (&ArrayType, &Ids),
        dest: &mut [&mut [f32]],
    ) -> Result<Option<TiedRows>, SpmdError> {
        let ([whole], Some(local)) = (dest, ids.local()) else {
            return Ok(None);
        };
        let Some(natural) = cx.take_transpose_in_place(table, ids)? else {
            return Ok(None);
        };
        let width: usize = natural
            .shard_shape()
            .get(1..)
            .map_or(0, |row| row.iter().product());
        let count = whole.len().checked_div(width).unwrap_or(0);
        if width == 0 || count * width != whole.len() || local.iter().any(|&r| r as usize >= count)
        {
            return Ok(None);
        }
        Ok(Some(TiedRows::of_rows(whole, width, local)))
    }

    /// Saves the rows `local` names (each once) of `whole`, in rows of `width` (every index
    /// below its row count), and sets them to `-0.0`.
    fn of_rows(whole: &mut [f32], width: usize, local: &[u32]) -> TiedRows {
        let mut rows: Vec<usize> = local.iter().map(|&r| r as usize).collect();
        rows.sort_unstable();
        rows.dedup();
        let mut saved = Vec::with_capacity(rows.len() * width);
        for &r in &rows {
            let row = &mut whole[r * width..(r + 1) * width];
            saved.extend_from_slice(row);
            row.fill(-0.0);
        }
        TiedRows { rows, width, saved }
    }

    /// Puts the saved rows back into `dest` untouched by the head's product (when it did not
    /// add after all).
    ///
    /// # Errors
    /// `dest` is not the buffer the rows were saved from (an internal error).
    pub(super) fn restore(&self, dest: &mut [&mut [f32]]) -> Result<(), SpmdError> {
        self.each_row(dest, |row, saved| row.copy_from_slice(saved))
    }

    /// Adds the saved rows back into `dest`, element by element (IEEE addition commutes, so
    /// `row + saved` has the bits of the handed path's `saved + row`).
    ///
    /// # Errors
    /// `dest` is not the buffer the rows were saved from (an internal error).
    pub(super) fn add_back(&self, dest: &mut [&mut [f32]]) -> Result<(), SpmdError> {
        self.each_row(dest, |row, saved| {
            for (d, &s) in row.iter_mut().zip(saved) {
                *d += s;
            }
        })
    }

    /// `f(row of dest, its saved values)` for every touched row.
    fn each_row(
        &self,
        dest: &mut [&mut [f32]],
        mut f: impl FnMut(&mut [f32], &[f32]),
    ) -> Result<(), SpmdError> {
        let mismatch = || SpmdError::Internal {
            op: "backward",
            invariant: "a tied table's set-aside rows go back into the buffer they came from",
        };
        let [whole] = dest else {
            return Err(mismatch());
        };
        for (&r, saved) in self.rows.iter().zip(self.saved.chunks(self.width)) {
            let row = whole
                .get_mut(r * self.width..(r + 1) * self.width)
                .ok_or_else(mismatch)?;
            f(row, saved);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::TiedRows;

    /// Set aside, added to, and added back, a touched row ends as `start + (y₁ + y₂)` to the bit
    /// for every start and contribution, signed zeros included (a `+0.0` in place of the
    /// `-0.0` turns `-0.0 + (-0.0 + -0.0)` into `+0.0`); untouched rows keep their values.
    #[test]
    fn a_set_aside_row_ends_as_its_start_plus_the_sum_of_its_contributions() {
        let values = [
            0.0f32,
            -0.0,
            1.5,
            -2.25,
            1e30,
            f32::MIN_POSITIVE / 4.0,
            3.0e7,
        ];
        for &start in &values {
            for &y1 in &values {
                for &y2 in &values {
                    let mut buffer = vec![start, 7.0, start, 7.0];
                    let rows = TiedRows::of_rows(&mut buffer, 1, &[2, 0, 2]);
                    for &y in &[y1, y2] {
                        buffer[0] += y;
                        buffer[2] += y;
                    }
                    rows.add_back(&mut [&mut buffer[..]]).unwrap();
                    let want = start + (y1 + y2);
                    for at in [0, 2] {
                        assert_eq!(buffer[at].to_bits(), want.to_bits(), "{start} {y1} {y2}");
                    }
                    assert_eq!([buffer[1], buffer[3]], [7.0, 7.0]);
                }
            }
        }
    }

    /// The rows go back only into a buffer that holds them.
    #[test]
    fn adding_back_into_another_buffer_is_an_error() {
        let mut buffer = vec![1.0f32; 8];
        let rows = TiedRows::of_rows(&mut buffer, 2, &[3]);
        assert!(rows.add_back(&mut [&mut [0.0f32; 4][..]]).is_err());
        assert!(rows.restore(&mut []).is_err());
        rows.restore(&mut [&mut buffer[..]]).unwrap();
        assert_eq!(buffer, vec![1.0; 8]);
    }
}
