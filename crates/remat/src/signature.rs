//! What makes stages alike to the planner ([`crate::Stage::signature`]): one typed value holding
//! everything that decides a stage's bytes and time (widths, heads, the dtype, adapters; floats as
//! their bits), compared by equality. Not a printed description: two values of the same type are
//! alike exactly where they are equal.
//!
//! Not here: how the planner reuses an alike stage's costs ([`crate::plan::Profile::measure`]).

use std::any::{Any, TypeId};
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// A stage's signature: stages with equal signatures, given inputs of equal shapes and dtypes,
/// allocate the same bytes and take the same time. `Signature::of(("gpt2 block", width, heads))`.
#[derive(Clone)]
pub struct Signature(Arc<dyn Key>);

impl Signature {
    /// The signature of `value`, a value of the stage's own choosing (a tuple, a struct) that
    /// holds what decides its costs.
    pub fn of<T: Eq + Hash + fmt::Debug + Send + Sync + 'static>(value: T) -> Self {
        Signature(Arc::new(value))
    }
}

/// A signature's value, compared and hashed through its own type.
trait Key: Send + Sync + fmt::Debug {
    fn as_any(&self) -> &dyn Any;
    fn equals(&self, other: &dyn Key) -> bool;
    fn hash_into(&self, state: &mut dyn Hasher);
}

impl<T: Eq + Hash + fmt::Debug + Send + Sync + 'static> Key for T {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn equals(&self, other: &dyn Key) -> bool {
        other.as_any().downcast_ref::<T>() == Some(self)
    }

    fn hash_into(&self, mut state: &mut dyn Hasher) {
        TypeId::of::<T>().hash(&mut state);
        self.hash(&mut state);
    }
}

impl PartialEq for Signature {
    fn eq(&self, other: &Self) -> bool {
        self.0.equals(other.0.as_ref())
    }
}

impl Eq for Signature {}

impl Hash for Signature {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.hash_into(state);
    }
}

impl fmt::Debug for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::Signature;

    #[test]
    fn alike_exactly_where_equal_and_of_one_type() {
        let set: std::collections::HashSet<Signature> = [
            Signature::of(("block", 64usize, 4usize)),
            Signature::of(("block", 64usize, 4usize)),
            Signature::of(("block", 64usize, 8usize)),
            Signature::of(("block", 64u32, 4u32)),
        ]
        .into_iter()
        .collect();
        assert_eq!(set.len(), 3, "equal values are one signature, another type is another");
    }
}
