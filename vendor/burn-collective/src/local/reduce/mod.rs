mod centralized;
mod op;
mod tree;

pub(crate) use centralized::*;
pub(crate) use op::*;
pub(crate) use tree::*;
