//! The macros every fused op's code uses: `per_float!` and `per_dtype!` dispatch on the element
//! type, `custom_op!` implements candle's `CustomOp1/2/3` for a `FusedOp`, `vectorised!` compiles
//! an elementwise loop for the widest vectors the processor has. Declared first in
//! `fused/mod.rs` (`#[macro_use]`): a `macro_rules!` is visible only below its definition. Not
//! here: the trait they implement (`op`), the storage they read (`storage`).

/// The storage `$body` makes, a `Vec` of f32 or f64 as `$s` holds (the element type is inferred
/// in each arm; half precision computes in f32 and is stored narrowed): the one dispatch every
/// fused op's forward needs.
macro_rules! per_float {
    ($s:expr, $name:literal, $body:expr) => {
        match $s {
            candle_core::CpuStorage::F32(_) => candle_core::CpuStorage::F32($body),
            candle_core::CpuStorage::F64(_) => candle_core::CpuStorage::F64($body),
            candle_core::CpuStorage::BF16(_) => {
                candle_core::CpuStorage::BF16($crate::fused::storage::narrow($body))
            }
            candle_core::CpuStorage::F16(_) => {
                candle_core::CpuStorage::F16($crate::fused::storage::narrow($body))
            }
            _ => candle_core::bail!(concat!("fused ", $name, ": float operands only")),
        }
    };
}

/// `$body` with the type `$t` set to f32 or f64 as `$dtype` says: the dispatch of the backward
/// passes and of the wrappers that read a tensor's elements.
macro_rules! per_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 | candle_core::DType::BF16 | candle_core::DType::F16 => {
                type $t = f32;
                $body
            }
            _ => {
                type $t = f64;
                $body
            }
        }
    };
}

/// Implements candle's `CustomOp1/2/3` for a [`FusedOp`], once per arity listed, each with the
/// name the op has at that arity: `custom_op!(LinearOp: 2 "fused-linear", 3 "fused-linear-bias");`.
/// Each impl sits in an anonymous const so that the `use`s it needs stay out of the caller's scope.
macro_rules! custom_op {
    ($op:ty: $($arity:tt $name:literal),+) => {
        $(custom_op!(@ $arity $op, $name);)+
    };
    (@ 1 $op:ty, $name:literal) => {
        const _: () = {
            use candle_core::{CpuStorage, Layout, Result, Shape, Tensor};
            use $crate::fused::op::{gradients, FusedOp};

            impl candle_core::CustomOp1 for $op {
                fn name(&self) -> &'static str {
                    $name
                }

                fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
                    FusedOp::cpu_fwd(self, &[(s, l)])
                }

                fn bwd(&self, x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
                    let [dx] = gradients(FusedOp::bwd(self, &[x], y, g)?, $name)?;
                    Ok(dx)
                }
            }
        };
    };
    (@ 2 $op:ty, $name:literal) => {
        const _: () = {
            use candle_core::{CpuStorage, Layout, Result, Shape, Tensor};
            use $crate::fused::op::{gradients, FusedOp};

            impl candle_core::CustomOp2 for $op {
                fn name(&self) -> &'static str {
                    $name
                }

                fn cpu_fwd(
                    &self,
                    s1: &CpuStorage,
                    l1: &Layout,
                    s2: &CpuStorage,
                    l2: &Layout,
                ) -> Result<(CpuStorage, Shape)> {
                    FusedOp::cpu_fwd(self, &[(s1, l1), (s2, l2)])
                }

                fn bwd(
                    &self,
                    x1: &Tensor,
                    x2: &Tensor,
                    y: &Tensor,
                    g: &Tensor,
                ) -> Result<(Option<Tensor>, Option<Tensor>)> {
                    let [d1, d2] = gradients(FusedOp::bwd(self, &[x1, x2], y, g)?, $name)?;
                    Ok((d1, d2))
                }
            }
        };
    };
    (@ 3 $op:ty, $name:literal) => {
        const _: () = {
            use candle_core::{CpuStorage, Layout, Result, Shape, Tensor};
            use $crate::fused::op::{gradients, FusedOp};

            impl candle_core::CustomOp3 for $op {
                fn name(&self) -> &'static str {
                    $name
                }

                fn cpu_fwd(
                    &self,
                    s1: &CpuStorage,
                    l1: &Layout,
                    s2: &CpuStorage,
                    l2: &Layout,
                    s3: &CpuStorage,
                    l3: &Layout,
                ) -> Result<(CpuStorage, Shape)> {
                    FusedOp::cpu_fwd(self, &[(s1, l1), (s2, l2), (s3, l3)])
                }

                fn bwd(
                    &self,
                    x1: &Tensor,
                    x2: &Tensor,
                    x3: &Tensor,
                    y: &Tensor,
                    g: &Tensor,
                ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
                    let [d1, d2, d3] = gradients(FusedOp::bwd(self, &[x1, x2, x3], y, g)?, $name)?;
                    Ok((d1, d2, d3))
                }
            }
        };
    };
}

/// A function over slices compiled three times, for AVX-512, for AVX2 with FMA and for any
/// processor, each call running the widest its processor has: the loops of the f32 formulas
/// (`exp`, GELU's), which the compiler vectorises for the vectors it may use, the formulas'
/// `#[inline(always)]` steps inlined into each. Every compilation does the same operations, fused
/// multiply-adds (`mul_add`, a library call in the last) and exact ones only, so all give the same
/// bits: the same inputs give the same outputs on any machine.
macro_rules! vectorised {
    ($(#[$doc:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$doc])*
        $vis fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) $body

                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $body

                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the processor has AVX-512F, checked above.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the processor has AVX2 and FMA, checked above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $body
        }
    };
}
