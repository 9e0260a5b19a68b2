//! FSDP units: which parameters are gathered and resharded together.
//!
//! PyTorch wraps *modules*, chosen by class or size. A tch model has no
//! module classes: it has a `VarStore` whose parameters are named by
//! dot-separated paths (`vs / "layers" / 3 / "fc1"` gives
//! `layers.3.fc1.weight`). accel-fsdp therefore reads the module tree off
//! those paths: every prefix of a parameter's path without its last segment
//! is a module (`layers`, `layers.3`, `layers.3.fc1`), the last segment is
//! the parameter's own name, and the empty prefix is the root module.
//!
//! Each parameter belongs to exactly one unit. The root unit (name `""`)
//! always exists, comes last, and holds every parameter no other unit
//! holds (possibly none). The other units are ordered by their first
//! parameter in the order the names are given.
//!
//! | `fsdp_auto_wrap_policy` | PyTorch | accel-fsdp |
//! | --- | --- | --- |
//! | `NO_WRAP` | the whole model is one FSDP unit | the root unit only |
//! | `TRANSFORMER_BASED_WRAP` | every module whose class is in `fsdp_transformer_layer_cls_to_wrap` (e.g. `BertLayer`) | every module whose **path segment** is one of those names, exactly (case-sensitive): with `fsdp_transformer_layer_cls_to_wrap: layers`, the parameters `layers.0.fc1.weight` and `layers.0.fc2.bias` form unit `layers.0`. When the segment after the match is an integer (a list index) the unit is the indexed item (`layers.3`), otherwise the matched module itself (`encoder`). The outermost match wins: a match inside an already matched module makes no unit of its own (PyTorch would nest one) |
//! | `SIZE_BASED_WRAP` | `size_based_auto_wrap_policy`: bottom-up, a module becomes a unit when the elements of its parameters not already in a unit below it reach `fsdp_min_num_params`; `ModuleList`/`ModuleDict` never do | the same on the path tree. A module that holds no parameters of its own and whose children are all integers (`layers` above `layers.0`, `layers.1`, ...) counts as a `ModuleList` and never becomes a unit (its elements count towards its parent). The root is the root unit, never a sized one. A module that would be a unit with no parameters (possible only with `fsdp_min_num_params: 0`) is dropped |
//!
//! A model can declare the class of its layers
//! (`Accelerator::declare_layer_class("GPT2Block", ["transformer.h.0", ...])`);
//! a `fsdp_transformer_layer_cls_to_wrap` name that is a declared class then
//! wraps those modules ([`units_with_classes`]), as PyTorch's class-based
//! policy; other names match path segments as above.
//!
//! A class name that matches nothing is not an error here; [`unmatched`]
//! lists them so that the strategy can refuse the config with a message
//! that shows the model's classes and what the paths look like.

use crate::settings::WrapPolicy;
use std::collections::HashMap;

/// One FSDP unit: the VarStore path prefix it wraps ("" for the root unit)
/// and the indices (into the given names) of its parameters, ascending.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unit {
    /// The module path (`layers.3`), `""` for the root unit.
    pub name: String,
    /// Indices into the parameter names, ascending.
    pub params: Vec<usize>,
}

/// Groups parameters (VarStore paths like "layers.3.fc1.weight",
/// dot-separated, given in any order) into units. The root unit (name "")
/// comes LAST and holds every parameter no other unit holds; it is always
/// present (possibly with no params). Other units are ordered by first
/// appearance in `names`. `numels[i]` is the element count of `names[i]`
/// (only `SizeBased` reads it; a missing or negative count counts as 0).
pub fn units(names: &[String], numels: &[i64], policy: &WrapPolicy) -> Vec<Unit> {
    units_with_classes(names, numels, policy, &[])
}

/// [`units`], with the layer classes the model declared (`(module path,
/// class)`, e.g. `("transformer.h.0", "GPT2Block")`): under
/// `TRANSFORMER_BASED_WRAP` a name that is a declared class wraps every
/// module declared of that class (the outermost when they nest), as
/// PyTorch's class-based policy; the other names match path segments.
pub fn units_with_classes(
    names: &[String],
    numels: &[i64],
    policy: &WrapPolicy,
    declared: &[(String, String)],
) -> Vec<Unit> {
    let mut out = match policy {
        WrapPolicy::NoWrap => Vec::new(),
        WrapPolicy::TransformerBased(classes) => {
            let mut taken = vec![false; names.len()];
            let mut out = declared_units(names, declared, classes, &mut taken);
            let segments: Vec<String> = classes
                .iter()
                .filter(|c| !declared.iter().any(|(_, d)| d == *c))
                .cloned()
                .collect();
            for mut u in transformer_units(names, &segments) {
                u.params.retain(|&i| !taken[i]);
                if !u.params.is_empty() {
                    out.push(u);
                }
            }
            out
        }
        WrapPolicy::SizeBased(min) => size_units(names, numels, *min),
    };
    out.sort_by_key(|u| u.params[0]);
    let mut wrapped = vec![false; names.len()];
    for u in &out {
        for &i in &u.params {
            wrapped[i] = true;
        }
    }
    out.push(Unit {
        name: String::new(),
        params: (0..names.len()).filter(|&i| !wrapped[i]).collect(),
    });
    out
}

/// The names of `classes` that are neither a declared layer class nor a
/// module segment of any of `names`, in the order given.
pub fn unmatched(
    classes: &[String],
    names: &[String],
    declared: &[(String, String)],
) -> Vec<String> {
    classes
        .iter()
        .filter(|c| {
            !declared.iter().any(|(_, d)| d == *c)
                && !names
                    .iter()
                    .any(|n| module_segments(n).contains(&c.as_str()))
        })
        .cloned()
        .collect()
}

/// One unit per declared module of a class in `classes` (outermost first;
/// a module inside a wrapped one makes no unit of its own), marking its
/// parameters `taken`.
fn declared_units(
    names: &[String],
    declared: &[(String, String)],
    classes: &[String],
    taken: &mut [bool],
) -> Vec<Unit> {
    let mut paths: Vec<&str> = declared
        .iter()
        .filter(|(_, c)| classes.contains(c))
        .map(|(p, _)| p.as_str())
        .collect();
    paths.sort_by_key(|p| p.split('.').count());
    let mut out = Vec::new();
    for path in paths {
        let prefix = format!("{path}.");
        let params: Vec<usize> = (0..names.len())
            .filter(|&i| !taken[i] && names[i].starts_with(&prefix))
            .collect();
        for &i in &params {
            taken[i] = true;
        }
        if !params.is_empty() {
            out.push(Unit {
                name: path.to_owned(),
                params,
            });
        }
    }
    out
}

/// The module part of a parameter path: every segment but the last.
fn module_segments(name: &str) -> Vec<&str> {
    let mut segs: Vec<&str> = name.split('.').collect();
    segs.pop();
    segs
}

fn is_index(seg: &str) -> bool {
    !seg.is_empty() && seg.bytes().all(|b| b.is_ascii_digit())
}

fn transformer_units(names: &[String], classes: &[String]) -> Vec<Unit> {
    let mut out: Vec<Unit> = Vec::new();
    let mut by_name: HashMap<String, usize> = HashMap::new();
    for (i, name) in names.iter().enumerate() {
        let segs = module_segments(name);
        let Some(j) = segs.iter().position(|s| classes.iter().any(|c| c == s)) else {
            continue;
        };
        let end = if segs.get(j + 1).is_some_and(|s| is_index(s)) {
            j + 2
        } else {
            j + 1
        };
        let prefix = segs[..end].join(".");
        let k = *by_name.entry(prefix.clone()).or_insert_with(|| {
            out.push(Unit {
                name: prefix,
                params: Vec::new(),
            });
            out.len() - 1
        });
        out[k].params.push(i);
    }
    out
}

/// One module of the path tree.
struct Node {
    /// Full path (`layers.3`).
    path: String,
    /// Last segment (`3`).
    segment: String,
    children: Vec<usize>,
    /// Parameters directly in this module.
    params: Vec<usize>,
}

fn size_units(names: &[String], numels: &[i64], min: u64) -> Vec<Unit> {
    let mut nodes = vec![Node {
        path: String::new(),
        segment: String::new(),
        children: Vec::new(),
        params: Vec::new(),
    }];
    let mut by_path: HashMap<String, usize> = HashMap::new();
    for (i, name) in names.iter().enumerate() {
        let mut at = 0;
        let mut path = String::new();
        for seg in module_segments(name) {
            if !path.is_empty() {
                path.push('.');
            }
            path.push_str(seg);
            at = match by_path.get(&path) {
                Some(&k) => k,
                None => {
                    nodes.push(Node {
                        path: path.clone(),
                        segment: seg.to_owned(),
                        children: Vec::new(),
                        params: Vec::new(),
                    });
                    let k = nodes.len() - 1;
                    nodes[at].children.push(k);
                    by_path.insert(path.clone(), k);
                    k
                }
            };
        }
        nodes[at].params.push(i);
    }
    let numel = |i: usize| numels.get(i).copied().unwrap_or(0).max(0) as u64;
    let mut out = Vec::new();
    // Returns the parameters of the subtree at `n` not in a unit below it.
    fn visit(
        n: usize,
        nodes: &[Node],
        numel: &dyn Fn(usize) -> u64,
        min: u64,
        out: &mut Vec<Unit>,
    ) -> Vec<usize> {
        let node = &nodes[n];
        let mut rest = node.params.clone();
        for &c in &node.children {
            rest.extend(visit(c, nodes, numel, min, out));
        }
        let list_like = node.params.is_empty()
            && !node.children.is_empty()
            && node.children.iter().all(|&c| is_index(&nodes[c].segment));
        let size: u64 = rest.iter().map(|&i| numel(i)).sum();
        if n != 0 && !list_like && !rest.is_empty() && size >= min {
            rest.sort_unstable();
            out.push(Unit {
                name: node.path.clone(),
                params: rest,
            });
            Vec::new()
        } else {
            rest
        }
    }
    visit(0, &nodes, &numel, min, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// `(unit name, parameter names)` of each unit.
    fn show(names: &[String], units: &[Unit]) -> Vec<(String, Vec<String>)> {
        units
            .iter()
            .map(|u| {
                (
                    u.name.clone(),
                    u.params.iter().map(|&i| names[i].clone()).collect(),
                )
            })
            .collect()
    }

    fn unit(name: &str, params: &[&str]) -> (String, Vec<String>) {
        (name.to_owned(), names(params))
    }

    /// 8 layers `layers.{0..7}.{weight,bias}` and `head.weight`.
    fn eight_layers() -> Vec<String> {
        let mut n = Vec::new();
        for i in 0..8 {
            n.push(format!("layers.{i}.weight"));
            n.push(format!("layers.{i}.bias"));
        }
        n.push("head.weight".into());
        n
    }

    #[test]
    fn no_wrap_is_the_root_unit_only() {
        let n = eight_layers();
        let u = units(&n, &[1; 17], &WrapPolicy::NoWrap);
        assert_eq!(
            u,
            vec![Unit {
                name: String::new(),
                params: (0..17).collect()
            }]
        );
        // Always a root unit, even with no parameters.
        assert_eq!(
            units(&[], &[], &WrapPolicy::NoWrap),
            vec![Unit {
                name: String::new(),
                params: Vec::new()
            }]
        );
    }

    #[test]
    fn transformer_based_wraps_indexed_layers() {
        let n = eight_layers();
        let u = units(
            &n,
            &[1; 17],
            &WrapPolicy::TransformerBased(vec!["layers".into()]),
        );
        assert_eq!(u.len(), 9);
        for (i, unit) in u[..8].iter().enumerate() {
            assert_eq!(unit.name, format!("layers.{i}"));
            assert_eq!(unit.params, vec![2 * i, 2 * i + 1]);
        }
        assert_eq!(show(&n, &u[8..]), vec![unit("", &["head.weight"])]);
        assert!(unmatched(&["layers".into()], &n, &[]).is_empty());
    }

    #[test]
    fn transformer_based_matches_exactly_and_outermost() {
        let n = names(&[
            "embed.weight",
            "encoder.attn.q.weight",
            "encoder.mlp.weight",
            "blocks.0.attn.q.weight",
            "blocks.0.mlp.weight",
            "decoder.attn.q.weight",
            "blocks.1.attn.q.weight",
            "Attn.weight",
            "x.attn",
        ]);
        let policy = WrapPolicy::TransformerBased(vec![
            "encoder".into(),
            "blocks".into(),
            "attn".into(),
            "BertLayer".into(),
        ]);
        let u = units(&n, &[1; 9], &policy);
        assert_eq!(
            show(&n, &u),
            vec![
                // A non-indexed match wraps the module itself; the nested
                // `attn` makes no unit of its own.
                unit("encoder", &["encoder.attn.q.weight", "encoder.mlp.weight"]),
                unit(
                    "blocks.0",
                    &["blocks.0.attn.q.weight", "blocks.0.mlp.weight"]
                ),
                unit("decoder.attn", &["decoder.attn.q.weight"]),
                unit("blocks.1", &["blocks.1.attn.q.weight"]),
                // Case-sensitive; a parameter's own name is not a module.
                unit("", &["embed.weight", "Attn.weight", "x.attn"]),
            ]
        );
        assert_eq!(
            unmatched(
                &["encoder".into(), "BertLayer".into(), "weight".into()],
                &n,
                &[]
            ),
            vec!["BertLayer".to_owned(), "weight".to_owned()]
        );
    }

    #[test]
    fn units_follow_first_appearance_in_any_order() {
        let n = names(&[
            "head.weight",
            "layers.1.weight",
            "layers.0.weight",
            "layers.1.bias",
        ]);
        let u = units(
            &n,
            &[1; 4],
            &WrapPolicy::TransformerBased(vec!["layers".into()]),
        );
        assert_eq!(
            show(&n, &u),
            vec![
                unit("layers.1", &["layers.1.weight", "layers.1.bias"]),
                unit("layers.0", &["layers.0.weight"]),
                unit("", &["head.weight"]),
            ]
        );
        // Everything wrapped: the root unit is empty but present.
        let n = names(&["layers.0.w", "layers.1.w"]);
        let u = units(
            &n,
            &[1; 2],
            &WrapPolicy::TransformerBased(vec!["layers".into()]),
        );
        assert_eq!(u.len(), 3);
        assert_eq!(
            u[2],
            Unit {
                name: String::new(),
                params: Vec::new()
            }
        );
    }

    #[test]
    fn size_based_thresholds() {
        // layers.i: weight 100 + bias 10 elements; head.weight 50.
        let n = eight_layers();
        let mut numels = Vec::new();
        for _ in 0..8 {
            numels.extend([100, 10]);
        }
        numels.push(50);
        let run = |min| units(&n, &numels, &WrapPolicy::SizeBased(min));

        // Each layer (110) reaches 110: one unit each; head (50) does not.
        let u = run(110);
        assert_eq!(u.len(), 9);
        for (i, unit) in u[..8].iter().enumerate() {
            assert_eq!(unit.name, format!("layers.{i}"));
            assert_eq!(unit.params, vec![2 * i, 2 * i + 1]);
        }
        assert_eq!(show(&n, &u[8..]), vec![unit("", &["head.weight"])]);

        // At 50 the head is a unit too.
        let u = run(50);
        assert_eq!(u.len(), 10);
        assert_eq!(
            show(&n, &u[8..]),
            vec![unit("head", &["head.weight"]), unit("", &[])]
        );

        // At 111 no layer is large enough, and `layers` (a list) never is a
        // unit: everything stays in the root, as torch's ModuleList rule.
        let u = run(111);
        assert_eq!(
            u,
            vec![Unit {
                name: String::new(),
                params: (0..17).collect()
            }]
        );
    }

    #[test]
    fn size_based_counts_only_what_is_not_wrapped_below() {
        let n = names(&[
            "enc.big.weight",   // 100
            "enc.small.weight", // 30
            "enc.norm",         // 30
            "dec.a.weight",     // 40
            "dec.b.weight",     // 40
            "out",              // 500: a root parameter
        ]);
        let numels = [100, 30, 30, 40, 40, 500];
        let u = units(&n, &numels, &WrapPolicy::SizeBased(60));
        assert_eq!(
            show(&n, &u),
            vec![
                // enc.big is a unit; enc then has 60 left (small + norm).
                unit("enc.big", &["enc.big.weight"]),
                unit("enc", &["enc.small.weight", "enc.norm"]),
                // Neither dec.a nor dec.b reaches 60; dec (80) does.
                unit("dec", &["dec.a.weight", "dec.b.weight"]),
                // The root is never a sized unit.
                unit("", &["out"]),
            ]
        );
        // Below the threshold everywhere: the root unit only.
        let u = units(&n, &numels, &WrapPolicy::SizeBased(1_000));
        assert_eq!(u.len(), 1);
        assert_eq!(u[0].params, (0..6).collect::<Vec<_>>());
        // A module with its own parameters and indexed children is not a list.
        let n = names(&["m.scale", "m.0.w", "m.1.w"]);
        let u = units(&n, &[1, 1, 1], &WrapPolicy::SizeBased(3));
        assert_eq!(
            show(&n, &u),
            vec![unit("m", &["m.scale", "m.0.w", "m.1.w"]), unit("", &[])]
        );
        // min 0: every module with parameters is a unit; none is empty.
        let u = units(&n, &[1, 1, 1], &WrapPolicy::SizeBased(0));
        assert_eq!(
            show(&n, &u),
            vec![
                unit("m", &["m.scale"]),
                unit("m.0", &["m.0.w"]),
                unit("m.1", &["m.1.w"]),
                unit("", &[]),
            ]
        );
    }
}
