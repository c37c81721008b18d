//! A CubeCL view that decodes FP8 codes on load: reading position `p` of a `[batch, rows, cols]` operand returns the
//! four decoded values of the `u32` word that holds codes `p..p + 4` along its packed (contiguous) dimension, as
//! `Vector<F, 4>`. cubek-matmul's global readers stage these vectors in shared memory, so its tiled matmuls run on
//! FP8 operands without an f32 copy. Every E4M3 and E5M2 value is exactly an f16 (and an f32) value, so the decoded
//! operand is exact in either stage type; the per-tensor scales are left to the output.

use std::marker::PhantomData;

use cubecl::prelude::barrier::BarrierExpand;
use cubecl::prelude::*;
use cubecl::std::tensor::layout::Coordinates;
use cubecl::std::tensor::{View, ViewExpand, ViewOperations, ViewOperationsExpand};
use cubecl::unexpanded;

use crate::format::Fp8Format;
use crate::kernel::fp8::decode_fp8;

/// Codes per `u32` word, the lanes of one decoded vector.
pub const CODES_PER_WORD: usize = 4;

/// A view of packed FP8 codes that reads decoded `Vector<F, N>` (`N` = [`CODES_PER_WORD`]).
#[expect(dead_code, reason = "read through its expansion")]
#[derive(CubeType, Clone, Copy)]
pub struct Fp8View<F: Numeric, N: Size, C: Coordinates + 'static> {
    codes: View<u32, C>,
    #[cube(comptime)]
    format: Fp8Format,
    #[cube(comptime)]
    _ty: PhantomData<(F, N)>,
}

#[cube]
impl<F: Numeric, N: Size, C: Coordinates + 'static> Fp8View<F, N, C> {
    /// The view of `codes` (one `u32` word per position, its layout packing [`CODES_PER_WORD`] codes).
    pub fn new(codes: View<u32, C>, #[comptime] format: Fp8Format) -> Self {
        Fp8View::<F, N, C> {
            codes,
            format,
            _ty: PhantomData,
        }
    }
}

impl<F: Numeric, N: Size, C: Coordinates + 'static> Fp8View<F, N, C> {
    /// As a [`View`] of decoded vectors.
    pub fn view(self) -> View<Vector<F, N>, C> {
        unexpanded!()
    }

    /// Expansion of [`Fp8View::view`].
    pub fn __expand_view(
        _scope: &mut Scope,
        this: Fp8ViewExpand<F, N, C>,
    ) -> ViewExpand<Vector<F, N>, C, ReadOnly> {
        this.__expand_view_method(_scope)
    }
}

/// The four codes of `word` (lowest byte first), decoded and cast to `F`.
#[cube]
pub fn decode_word<F: Numeric, N: Size>(word: u32, #[comptime] format: Fp8Format) -> Vector<F, N> {
    let mut out = Vector::<F, N>::empty();
    #[unroll]
    for lane in 0..CODES_PER_WORD {
        let code = (word >> (8 * lane) as u32) & 0xff;
        out[lane] = F::cast_from(decode_fp8(code, format));
    }
    out
}

impl<F: Numeric, N: Size, C: Coordinates + 'static> Fp8ViewExpand<F, N, C> {
    /// Expansion of [`Fp8View::view`] as a method.
    pub fn __expand_view_method(self, _scope: &mut Scope) -> ViewExpand<Vector<F, N>, C, ReadOnly> {
        ViewExpand::new(self)
    }
}

impl<F: Numeric, N: Size, C: Coordinates + 'static> Vectorized for Fp8View<F, N, C> {}

impl<F: Numeric, N: Size, C: Coordinates + 'static> VectorizedExpand for Fp8ViewExpand<F, N, C> {
    fn vector_size(&self) -> VectorSize {
        CODES_PER_WORD
    }
}

impl<F: Numeric, N: Size, C: Coordinates + 'static> ViewOperations<Vector<F, N>, C>
    for Fp8View<F, N, C>
{
}

impl<F: Numeric, N: Size, C: Coordinates + 'static> ViewOperationsExpand<Vector<F, N>, C>
    for Fp8ViewExpand<F, N, C>
{
    fn __expand_read_method(
        &self,
        scope: &mut Scope,
        pos: <C>::ExpandType,
    ) -> NativeExpand<Vector<F, N>> {
        let word = self.codes.clone().__expand_read_method(scope, pos);
        decode_word::expand::<F, N>(scope, word, self.format)
    }

    fn __expand_read_checked_method(
        &self,
        scope: &mut Scope,
        pos: <C>::ExpandType,
    ) -> NativeExpand<Vector<F, N>> {
        // Out of bounds reads as word 0: four +0 codes.
        let word = self.codes.clone().__expand_read_checked_method(scope, pos);
        decode_word::expand::<F, N>(scope, word, self.format)
    }

    fn __expand_read_masked_method(
        &self,
        scope: &mut Scope,
        pos: <C>::ExpandType,
        mask_value: NativeExpand<Vector<F, N>>,
    ) -> NativeExpand<Vector<F, N>> {
        let word = self
            .codes
            .clone()
            .__expand_read_checked_method(scope, pos.clone());
        let in_bounds = self.__expand_is_in_bounds_method(scope, pos);
        let value = decode_word::expand::<F, N>(scope, word, self.format);
        select::expand::<Vector<F, N>>(scope, in_bounds, value, mask_value)
    }

    fn __expand_read_unchecked_method(
        &self,
        scope: &mut Scope,
        pos: <C>::ExpandType,
    ) -> NativeExpand<Vector<F, N>> {
        let word = self
            .codes
            .clone()
            .__expand_read_unchecked_method(scope, pos);
        decode_word::expand::<F, N>(scope, word, self.format)
    }

    fn __expand_to_linear_slice_method(
        &self,
        _scope: &mut Scope,
        _pos: <C>::ExpandType,
        _end: <C>::ExpandType,
    ) -> SliceExpand<Vector<F, N>, ReadOnly> {
        // A kernel-compile-time error: the FP8 GEMM only launches routines whose readers load vector by vector.
        panic!("FP8 codes are decoded on load: no raw slice of an Fp8View")
    }

    fn __expand_shape_method(&self, scope: &mut Scope) -> <C>::ExpandType {
        self.codes.clone().__expand_shape_method(scope)
    }

    fn __expand_is_in_bounds_method(
        &self,
        scope: &mut Scope,
        pos: C::ExpandType,
    ) -> NativeExpand<bool> {
        self.codes.clone().__expand_is_in_bounds_method(scope, pos)
    }

    fn __expand_tensor_map_load_method(
        &self,
        _scope: &mut Scope,
        _barrier: BarrierExpand,
        _shared_memory: SliceExpand<Vector<F, N>, ReadWrite>,
        _pos: C::ExpandType,
    ) {
        panic!("FP8 codes are decoded on load: no TMA load of an Fp8View")
    }
}
