//! A CubeCL view that decodes quantized codes on load: reading position `p` of a `[batch, rows, cols]` operand
//! returns the decoded values of the `u32` word that holds the codes `p..p + w` along its packed (contiguous)
//! dimension (`w` = 4 FP8 codes or 8 of NVFP4's E2M1 codes), as a `w`-lane vector; with block scales, each value
//! times its block's scale (one f32 rounding, as the SIMT kernel stages it). cubek-matmul's global readers stage
//! these vectors in shared memory, so its tiled matmuls run on quantized operands without a dequantized copy.
//!
//! Every E4M3, E5M2 and E2M1 value is exactly an f16 (and an f32) value, so a decoded operand without block scales
//! is exact in either stage type; its per-tensor scale is left to the output.

use std::marker::PhantomData;

use cubecl::features::TypeUsage;
use cubecl::ir::{ElemType, FloatKind, StorageType};
use cubecl::prelude::barrier::BarrierExpand;
use cubecl::prelude::*;
use cubecl::std::tensor::layout::Coordinates;
use cubecl::std::tensor::{View, ViewExpand, ViewOperations, ViewOperationsExpand};
use cubecl::unexpanded;
use cubecl::{e4m3, e5m2};

use crate::Fp8Format;
use crate::kernel::code::{CodeFormat, decode};

/// One of a view's reads (checked, unchecked, ...) at a position.
type Read<T, C> = fn(&ViewExpand<T, C>, &mut Scope, <C as CubeType>::ExpandType) -> NativeExpand<T>;

/// Codes per `u32` word.
pub const fn codes_per_word(element: CodeFormat) -> usize {
    match element {
        CodeFormat::Fp8(_) => 4,
        CodeFormat::E2m1 => 8,
    }
}

/// A view of packed codes that reads decoded `Vector<F, N>` (`N` = [`codes_per_word`]), each value times its
/// block's scale where the operand has block scales.
#[expect(dead_code, reason = "read through its expansion")]
#[derive(CubeType, Clone, Copy)]
pub struct CodeView<F: Numeric, N: Size, C: Coordinates + 'static> {
    codes: View<u32, C>,
    scales: ComptimeOption<View<f32, C>>,
    #[cube(comptime)]
    element: CodeFormat,
    #[cube(comptime)]
    _ty: PhantomData<(F, N)>,
}

#[cube]
impl<F: Numeric, N: Size, C: Coordinates + 'static> CodeView<F, N, C> {
    /// The view of `codes` (one `u32` word per position, its layout packing [`codes_per_word`] codes), scaled by
    /// `scales` (a view of the block scales at the values' positions) where given.
    pub fn new(
        codes: View<u32, C>,
        scales: ComptimeOption<View<f32, C>>,
        #[comptime] element: CodeFormat,
    ) -> Self {
        CodeView::<F, N, C> {
            codes,
            scales,
            element,
            _ty: PhantomData,
        }
    }
}

impl<F: Numeric, N: Size, C: Coordinates + 'static> CodeView<F, N, C> {
    /// As a [`View`] of decoded vectors.
    pub fn view(self) -> View<Vector<F, N>, C> {
        unexpanded!()
    }

    /// Expansion of [`CodeView::view`].
    pub fn __expand_view(
        scope: &mut Scope,
        this: CodeViewExpand<F, N, C>,
    ) -> ViewExpand<Vector<F, N>, C, ReadOnly> {
        this.__expand_view_method(scope)
    }
}

impl<F: Numeric, N: Size, C: Coordinates + 'static> CodeViewExpand<F, N, C> {
    /// Expansion of [`CodeView::view`] as a method.
    pub fn __expand_view_method(self, _scope: &mut Scope) -> ViewExpand<Vector<F, N>, C, ReadOnly> {
        ViewExpand::new(self)
    }

    /// The decoded word at `pos`, read with `read` (checked or not), times the block scale at `pos` if any. FP8
    /// codes without block scales take the device's own conversion where it has one ([`native_conversion`]).
    fn decoded(
        &self,
        scope: &mut Scope,
        pos: C::ExpandType,
        read: Read<u32, C>,
        read_scale: Read<f32, C>,
    ) -> NativeExpand<Vector<F, N>> {
        let word = read(&self.codes, scope, pos.clone());
        match &self.scales {
            ComptimeOptionExpand::None => word_values::expand::<F, N>(scope, word, self.element),
            ComptimeOptionExpand::Some(scales) => {
                let scale = read_scale(scales, scope, pos);
                decode_word::expand::<F, N>(scope, word, scale, self.element)
            }
        }
    }
}

/// The codes of `word` (lowest bits first) as `F` values, unscaled: the device's own conversion where it has one
/// ([`native_conversion`], [`converted_word()`]), [`decode_word()`] elsewhere. Exact for every code in f16 and f32.
#[allow(unused_variables)]
pub fn word_values<F: Numeric, N: Size>(word: u32, element: CodeFormat) -> Vector<F, N> {
    unexpanded!()
}

/// Expansion of [`word_values()`]: the conversion is chosen for the device the kernel is expanded for.
pub mod word_values {
    use super::*;

    /// Expands [`word_values()`](fn@super::word_values).
    pub fn expand<F: Numeric, N: Size>(
        scope: &mut Scope,
        word: NativeExpand<u32>,
        element: CodeFormat,
    ) -> NativeExpand<Vector<F, N>> {
        match native_conversion(scope, element) {
            Some(format) => converted_word::expand::<F, N>(scope, word, format),
            None => decode_word::expand::<F, N>(scope, word, 1.0f32.into(), element),
        }
    }
}

/// The FP8 format of `element` where the device the kernel is expanded for converts it in hardware (CubeCL's
/// `TypeUsage::Conversion`: CUDA from sm 89, Vulkan with `VK_EXT_shader_float8`), `None` elsewhere (lavapipe, WGSL,
/// E2M1 words).
pub fn native_conversion(scope: &Scope, element: CodeFormat) -> Option<Fp8Format> {
    let CodeFormat::Fp8(format) = element else {
        return None;
    };
    let kind = match format {
        Fp8Format::E4M3 => FloatKind::E4M3,
        Fp8Format::E5M2 => FloatKind::E5M2,
    };
    let properties = scope.properties.as_ref()?;
    properties
        .type_usage(StorageType::Scalar(ElemType::Float(kind)))
        .contains(TypeUsage::Conversion)
        .then_some(format)
}

/// The four FP8 codes of `word` (lowest bits first) as the device's own FP8 type, converted to `F` by the device:
/// two codes per instruction on CUDA (`cvt.rn.f16x2.e4m3x2`), where [`decode_word()`] spends about twenty integer
/// and float operations per code. Exact: every E4M3 and E5M2 value, NaN and infinity included, is an f16 and an f32
/// value.
#[cube]
pub fn converted_word<F: Numeric, N: Size>(
    word: u32,
    #[comptime] format: Fp8Format,
) -> Vector<F, N> {
    if comptime!(format == Fp8Format::E4M3) {
        Vector::<F, N>::cast_from(Vector::<e4m3, N>::reinterpret(word))
    } else {
        Vector::<F, N>::cast_from(Vector::<e5m2, N>::reinterpret(word))
    }
}

/// The codes of `word` (lowest bits first), decoded, each times `scale` in f32 (the SIMT kernel's staging: one
/// rounding; exact for a power of two and for 1), and cast to `F`.
#[cube]
pub fn decode_word<F: Numeric, N: Size>(
    word: u32,
    scale: f32,
    #[comptime] element: CodeFormat,
) -> Vector<F, N> {
    let lanes = comptime!(codes_per_word(element));
    let bits = comptime!(32 / lanes);
    let mask = comptime!((1u32 << bits) - 1);
    let mut out = Vector::<F, N>::empty();
    #[unroll]
    for lane in 0..lanes {
        let code = (word >> (bits * lane) as u32) & mask;
        out[lane] = F::cast_from(decode(code, element) * scale);
    }
    out
}

impl<F: Numeric, N: Size, C: Coordinates + 'static> Vectorized for CodeView<F, N, C> {}

impl<F: Numeric, N: Size, C: Coordinates + 'static> VectorizedExpand for CodeViewExpand<F, N, C> {
    fn vector_size(&self) -> VectorSize {
        codes_per_word(self.element)
    }
}

impl<F: Numeric, N: Size, C: Coordinates + 'static> ViewOperations<Vector<F, N>, C>
    for CodeView<F, N, C>
{
}

impl<F: Numeric, N: Size, C: Coordinates + 'static> ViewOperationsExpand<Vector<F, N>, C>
    for CodeViewExpand<F, N, C>
{
    fn __expand_read_method(
        &self,
        scope: &mut Scope,
        pos: <C>::ExpandType,
    ) -> NativeExpand<Vector<F, N>> {
        self.decoded(
            scope,
            pos,
            |v, s, p| v.clone().__expand_read_method(s, p),
            |v, s, p| v.clone().__expand_read_method(s, p),
        )
    }

    fn __expand_read_checked_method(
        &self,
        scope: &mut Scope,
        pos: <C>::ExpandType,
    ) -> NativeExpand<Vector<F, N>> {
        // Out of bounds reads word 0 (+0 codes) and scale 0.
        self.decoded(
            scope,
            pos,
            |v, s, p| v.clone().__expand_read_checked_method(s, p),
            |v, s, p| v.clone().__expand_read_checked_method(s, p),
        )
    }

    fn __expand_read_masked_method(
        &self,
        scope: &mut Scope,
        pos: <C>::ExpandType,
        mask_value: NativeExpand<Vector<F, N>>,
    ) -> NativeExpand<Vector<F, N>> {
        let value = self.__expand_read_checked_method(scope, pos.clone());
        let in_bounds = self.__expand_is_in_bounds_method(scope, pos);
        select::expand::<Vector<F, N>>(scope, in_bounds, value, mask_value)
    }

    fn __expand_read_unchecked_method(
        &self,
        scope: &mut Scope,
        pos: <C>::ExpandType,
    ) -> NativeExpand<Vector<F, N>> {
        self.decoded(
            scope,
            pos,
            |v, s, p| v.clone().__expand_read_unchecked_method(s, p),
            |v, s, p| v.clone().__expand_read_unchecked_method(s, p),
        )
    }

    fn __expand_to_linear_slice_method(
        &self,
        _scope: &mut Scope,
        _pos: <C>::ExpandType,
        _end: <C>::ExpandType,
    ) -> SliceExpand<Vector<F, N>, ReadOnly> {
        // A kernel-compile-time error: the tiled GEMM only launches routines whose readers load vector by vector.
        panic!("codes are decoded on load: no raw slice of a CodeView")
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
        panic!("codes are decoded on load: no TMA load of a CodeView")
    }
}
