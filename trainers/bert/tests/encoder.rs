//! The encoder's output: a padded batch gives every sentence the hidden states it has alone,
//! token types reach the output, and the hidden states match an independent implementation,
//! `candle-transformers`' `BertModel`, loaded from the same weights.

use bert::{Bert, Config};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use trainable::Model;

fn model() -> Bert {
    Bert::new(Config::tiny(3, 32), &Device::Cpu, 4).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
}

const LONG: [u32; 9] = [2, 17, 40, 9, 88, 31, 5, 77, 3];
const SHORT: [u32; 5] = [2, 12, 61, 19, 3];

#[test]
fn padding_leaves_each_sentence_as_it_is_alone() {
    let model = model();
    let t = LONG.len();
    let padded: Vec<u32> =
        LONG.iter().chain(&SHORT).copied().chain(std::iter::repeat_n(0, t - SHORT.len())).collect();
    let ids = Tensor::from_vec(padded, (2, t), &Device::Cpu).unwrap();
    let mask: Vec<f32> = (0..2 * t).map(|i| if i < t + SHORT.len() { 1.0 } else { 0.0 }).collect();
    let mask = Tensor::from_vec(mask, (2, t), &Device::Cpu).unwrap();
    // (2, T, C)
    let batch = model.hidden_states(&ids, None, Some(&mask), remat::RunMode::Eval).unwrap();

    let alone = |s: &[u32]| {
        model
            .hidden_states(
                &Tensor::new(s, &Device::Cpu).unwrap().unsqueeze(0).unwrap(),
                None,
                None,
                remat::RunMode::Eval,
            )
            .unwrap()
    };
    let long = max_diff(&batch.narrow(0, 0, 1).unwrap(), &alone(&LONG));
    let short = max_diff(
        &batch.narrow(0, 1, 1).unwrap().narrow(1, 0, SHORT.len()).unwrap(),
        &alone(&SHORT),
    );
    eprintln!("largest difference to the sentence alone: long {long:.1e}, short {short:.1e}");
    assert!(long <= 1e-6 && short <= 1e-6, "long {long}, short {short}");
    // Without the mask the padding changes the short sentence: the test can tell.
    let unmasked = model.hidden_states(&ids, None, None, remat::RunMode::Eval).unwrap();
    assert!(
        max_diff(
            &unmasked.narrow(0, 1, 1).unwrap().narrow(1, 0, SHORT.len()).unwrap(),
            &alone(&SHORT)
        ) > 1e-3
    );
}

#[test]
fn token_types_change_the_output() {
    let model = model();
    let ids = Tensor::new(&[LONG], &Device::Cpu).unwrap();
    let segment_b = Tensor::new(&[[0u32, 0, 0, 0, 1, 1, 1, 1, 1]], &Device::Cpu).unwrap();
    let a = model.hidden_states(&ids, None, None, remat::RunMode::Eval).unwrap();
    let zeros = model
        .hidden_states(&ids, Some(&ids.zeros_like().unwrap()), None, remat::RunMode::Eval)
        .unwrap();
    assert_eq!(max_diff(&a, &zeros), 0.0, "the default is segment A");
    let b = model.hidden_states(&ids, Some(&segment_b), None, remat::RunMode::Eval).unwrap();
    assert!(
        max_diff(&a.narrow(1, 0, 1).unwrap(), &b.narrow(1, 0, 1).unwrap()) > 0.0,
        "attention mixes segment B into every token"
    );
    assert!(max_diff(&a.narrow(1, 4, 5).unwrap(), &b.narrow(1, 4, 5).unwrap()) > 1e-2);
}

#[test]
fn hidden_states_match_candle_transformers_bert() {
    let model = model();
    let weights: HashMap<String, Tensor> = model
        .params()
        .named()
        .filter_map(|(n, v)| Some((n.strip_prefix("bert.")?.to_string(), v.as_tensor().clone())))
        .collect();
    let vb = candle_nn::VarBuilder::from_tensors(weights, DType::F32, &Device::Cpu);
    let mut json = serde_json::to_value(&model.config).unwrap();
    for (k, v) in [
        ("hidden_act", "\"gelu\""),
        ("initializer_range", "0.02"),
        ("pad_token_id", "0"),
        ("classifier_dropout", "null"),
        ("model_type", "null"),
    ] {
        json[k] = serde_json::from_str(v).unwrap();
    }
    let config: candle_transformers::models::bert::Config = serde_json::from_value(json).unwrap();
    let reference = candle_transformers::models::bert::BertModel::load(vb, &config).unwrap();

    let t = LONG.len();
    let padded: Vec<u32> =
        LONG.iter().chain(&SHORT).copied().chain(std::iter::repeat_n(0, t - SHORT.len())).collect();
    let ids = Tensor::from_vec(padded, (2, t), &Device::Cpu).unwrap();
    let types = Tensor::from_vec(
        (0..2 * t as u32).map(|i| u32::from(i % t as u32 >= 4)).collect(),
        (2, t),
        &Device::Cpu,
    )
    .unwrap();
    let mask = Tensor::from_vec(
        (0..2 * t).map(|i| u32::from(i < t + SHORT.len())).collect(),
        (2, t),
        &Device::Cpu,
    )
    .unwrap();
    let theirs = reference.forward(&ids, &types, Some(&mask)).unwrap();
    let ours = model
        .hidden_states(
            &ids,
            Some(&types),
            Some(&mask.to_dtype(DType::F32).unwrap()),
            remat::RunMode::Eval,
        )
        .unwrap();
    let worst = max_diff(&ours, &theirs);
    eprintln!("largest difference to candle-transformers: {worst:.1e}");
    assert!(worst <= 1e-5, "{worst}");
}
