//! The one training path every trainer binary takes, from its command line to a trained model
//! ([`main`]), with the checks that hold for every model. A trainer brings only what is its own
//! as a [`Recipe`]: its model type, its flags, its data and its startup line; a check added to
//! [`train`] holds for every trainer.
//!
//! Not here: the loop itself ([`crate::Trainer`]), the shared flags ([`crate::RunArgs`]).

use crate::args::{Defaults, RunArgs};
use crate::hub::{HubArgs, HubFiles, Sources};
use crate::inputs::{Input, Reads};
use crate::lora::{LoraArgs, LoraSetup, Peft};
use crate::parallel::Group;
use crate::snapshot::RunConfig;
use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use remat::Policy;
use serde::Serialize;
use trainable::{Benchable, ModelConfig};

/// A model's configuration.
pub type ConfigOf<R> = <<R as Recipe>::Model as Benchable>::Config;

/// What a trainer binary brings to the training path: implemented by its command line.
pub trait Recipe: clap::Parser {
    /// The model it trains.
    type Model: Benchable;
    /// Where its batches come from.
    type Data;
    /// The model's name, as a training snapshot keeps it: `GPT-2`.
    const MODEL: &'static str;
    /// What its errors call the flags that choose the model: `--preset, --config or --model-id`.
    const MODEL_FLAGS: &'static str;

    /// The shared flags' defaults that suit this model.
    fn defaults() -> Defaults;

    /// The flags it shares with other trainers.
    fn flags(&self) -> Flags<'_>;

    /// The flag that sets each sample's size and its value: `("--seq", 256)`.
    fn input_size(&self) -> (&'static str, usize);

    /// The model's configuration as its preset and its own flags choose it (where no
    /// `config.json` is given), before the shared flags set their part.
    fn preset(&self) -> ConfigOf<Self>;

    /// Refuses flags the configuration cannot take (a sequence longer than its context), before
    /// anything is allocated. Default: none.
    fn check(&self, config: &ConfigOf<Self>) -> Result<()> {
        let _ = config;
        Ok(())
    }

    /// The data; what the data decides of the model (a folder's classes, the volumes' channels)
    /// is set in `config`. `hub`: the `--model-id`'s files (its tokenizer).
    fn data(&self, config: &mut ConfigOf<Self>, hub: Option<&HubFiles>) -> Result<Self::Data>;

    /// The graph inputs of data batch `step`, of `n` samples, on the model's device.
    fn inputs(
        &self,
        model: &Self::Model,
        data: &Self::Data,
        step: u64,
        n: usize,
    ) -> Result<Vec<Tensor>>;

    /// The inputs the planner measures a batch of `n` with. Default: data batch 0's (a trainer
    /// whose batches differ in size gives its largest).
    fn planned_inputs(
        &self,
        model: &Self::Model,
        data: &Self::Data,
        n: usize,
    ) -> Result<Vec<Tensor>> {
        self.inputs(model, data, 0, n)
    }

    /// How many distinct samples the data holds, where it holds a fixed number (a file's
    /// windows, a folder's images): evaluation batches beyond them would repeat. Default: an
    /// endless supply (synthetic images).
    fn samples(&self, data: &Self::Data) -> Option<usize> {
        let _ = data;
        None
    }

    /// What each data batch is, where the data comes from files: named in the error of a step
    /// whose gradients are not finite. Default: nothing to name.
    fn batch_names<'a>(&'a self, data: &'a Self::Data) -> Option<BatchNames<'a>> {
        let _ = data;
        None
    }

    /// The files this trainer's own flags make it read (`--text`, `--tokenizer`, `--vocab`), with
    /// their flags (`hub`: the `--model-id`'s files, where its tokenizer is one): checked before
    /// anything is built, and no output may be one of them. Default: none.
    fn read_files(&self, hub: Option<&HubFiles>) -> Vec<Input> {
        let _ = hub;
        Vec::new()
    }

    /// This trainer's own flags that decide what a run computes, as a struct whose fields are
    /// the flags (`seq` is `--seq`): its training snapshots keep them and a resume must match.
    fn setup(&self, config: &ConfigOf<Self>) -> impl Serialize;

    /// The line that starts training, once the policy is settled (`segments`: "3 segments").
    fn describe(
        &self,
        model: &Self::Model,
        data: &Self::Data,
        policy: &Policy,
        segments: &str,
    ) -> String;
}

/// The flags a trainer shares with others, as the training path reads them.
pub struct Flags<'a> {
    pub run: &'a RunArgs,
    /// Where the configuration and the weights may come from besides the presets.
    pub sources: Sources<'a>,
    /// `--lora` and its companions with what PEFT knows of the model's layers, where the model
    /// takes adapters.
    pub lora: Option<(&'a LoraArgs, &'static Peft)>,
}

impl<'a> Flags<'a> {
    /// A trainer whose model comes from its presets alone and takes no adapters.
    pub fn run(run: &'a RunArgs) -> Self {
        Flags { run, sources: Sources::default(), lora: None }
    }
}

/// What data batch `step` of `per_step` samples is, by the files it comes from.
pub type BatchNames<'a> = Box<dyn Fn(u64, usize) -> String + 'a>;

/// A trainer's `main`: parses the command line into `R` with its defaults, starts the run on its
/// ranks (under `--ranks N` this process re-runs itself under mpirun, [`crate::launch`]) and
/// runs [`train`] on each, a failing rank stopping them all ([`crate::or_abort`]); a run ended by
/// Ctrl-C exits with [`crate::interrupt::EXIT`] once its snapshot is written.
pub fn main<R: Recipe>() -> Result<()> {
    let args: R = crate::args::parse(R::defaults());
    let Some((group, device)) = crate::launch(args.flags().run)? else { return Ok(()) };
    let result = train(&args, &group, &device);
    if result.as_ref().is_err_and(|e| e.is::<crate::interrupt::Interrupted>()) {
        std::process::exit(crate::interrupt::EXIT);
    }
    crate::or_abort(&group, result)
}

/// One rank's training of the model `args` chooses, as its flags ask: configuration, the checks
/// that refuse what cannot run before anything is built, data, model, pre-trained weights and
/// adapters, the loop, the adapter written.
pub fn train<R: Recipe>(args: &R, group: &Group, device: &Device) -> Result<()> {
    let Flags { run, sources, lora: lora_flags } = args.flags();
    let hub = sources.hub.map(HubArgs::files).transpose()?.flatten();
    let files = read_files(args, hub.as_ref());
    crate::inputs::check(&files)?;
    let mut config = match crate::hub::config_file(sources.config, hub.as_ref()) {
        Some(path) => ConfigOf::<R>::from_json(path)?,
        None => args.preset(),
    };
    config.set_precision(run.dtype);
    config.set_freeze(run.freeze.clone().unwrap_or_default());
    let lora = match (lora_flags, config.lora_width()) {
        (Some((flags, peft)), Some(width)) => flags.config(peft, width)?,
        _ => None,
    };
    if let Some(lora) = &lora {
        config.set_lora(lora.clone()).map_err(anyhow::Error::msg).context("--lora")?;
    }
    args.check(&config)?;
    check_sizes(args, &config, lora.is_some())?;
    let data = args.data(&mut config, hub.as_ref())?;

    let model =
        crate::build_model(R::MODEL_FLAGS, || Ok(R::Model::build(&config, device, run.seed)?))?;
    if let Some(init) = sources.init {
        init.load(&model, hub.as_ref())?;
    }
    if let Some((flags, peft)) = lora_flags {
        flags.prepare(lora.as_ref(), &model, peft.targets)?;
    }
    let inputs = |step: u64, n: usize| args.inputs(&model, &data, step, n);
    let planned = |n: usize| args.planned_inputs(&model, &data, n);
    let per_step = run.batch * group.world();
    let batch_names = args.batch_names(&data).map(|names| {
        Box::new(move |step| names(step, per_step)) as Box<dyn Fn(u64) -> String + '_>
    });
    let (flag, size) = args.input_size();
    let setup = (args.setup(&config), lora.as_ref().map(LoraSetup::from));
    let mut run_config = RunConfig::new(run, group.world(), &setup)?.model(R::MODEL, &config)?;
    // Read whole only where a training snapshot keeps it or a resume compares it.
    if run.save.is_some() || run.resume.is_some() {
        run_config = run_config.contents(crate::inputs::fingerprints(&files)?);
    }
    let trainer = crate::Trainer {
        run,
        group,
        model: &model,
        sizes: format!("--batch {} x {flag} {size}", run.batch),
        config: run_config,
        outputs: lora_flags.map(|(flags, _)| flags.outputs()).unwrap_or_default(),
        inputs: files,
        samples: args.samples(&data),
        planned_inputs: &planned,
        batch_names,
    };
    trainer.run(&inputs, |policy, segments| args.describe(&model, &data, policy, segments))?;
    if let Some((flags, peft)) = lora_flags {
        // PEFT names the base model by its hub id; a model from a preset or a config.json has
        // none.
        let base_model = sources.hub.and_then(|h| h.model_id.as_deref()).unwrap_or_default();
        flags.save(lora.as_ref(), &model, (base_model, peft), group)?;
    }
    Ok(())
}

/// Every file the run reads, with its flag: the shared flags' (`--resume`, `--config`, `--init`,
/// the `--model-id`'s files, `--load-adapter`'s) and the trainer's own ([`Recipe::read_files`]).
fn read_files<R: Recipe>(args: &R, hub: Option<&HubFiles>) -> Vec<Input> {
    let Flags { run, sources, lora } = args.flags();
    let weights = [
        ("--resume", run.resume.as_deref()),
        ("--init", sources.init.and_then(|i| i.init.as_deref())),
    ];
    let weights =
        weights.into_iter().filter_map(|(flag, p)| Some(Input::file(flag, p?, Reads::Weights)));
    let adapter = lora.and_then(|(flags, _)| flags.load_adapter.as_deref());
    let adapter_files = adapter.into_iter().flat_map(|dir| {
        let file = |name: &&str| {
            Input::file(&format!("--load-adapter's {name}"), &dir.join(name), Reads::Other)
        };
        params::lora::ADAPTER_FILES.iter().map(file).collect::<Vec<_>>()
    });
    // A sharded checkpoint's index names the shards it reads.
    let shards = [sources.init.and_then(|i| i.init.as_deref()), hub.map(|h| h.weights.as_path())]
        .into_iter()
        .flatten()
        .filter(|p| params::is_index(p))
        .flat_map(|index| params::shards(index).unwrap_or_default())
        .map(|shard| Input::file("a sharded checkpoint's", &shard, Reads::Other))
        .collect::<Vec<_>>();
    let hub_files = hub.into_iter().flat_map(|h| {
        // Its tokenizer decides what is computed only under --text: the trainer's own files.
        let tokenizer = h.tokenizer.as_ref().map(|p| (p, Reads::Other));
        let files = [Some((&h.config, Reads::Setup)), Some((&h.weights, Reads::Other)), tokenizer];
        files.into_iter().flatten().map(|(p, reads)| {
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            Input::file(&format!("--model-id's {name}"), p, reads)
        })
    });
    let config = sources.config.map(|p| Input::file("--config", p, Reads::Setup));
    let own = args.read_files(hub);
    weights.chain(shards).chain(config).chain(adapter_files).chain(hub_files).chain(own).collect()
}

/// Refuses sizes no machine here could hold, before anything is built: the tensor every step of
/// `--batch` samples holds ([`Benchable::step_floor`]), and the parameters with their gradients
/// (only the weights under LoRA, whose base gets none), from the configuration alone: a
/// `config.json` of 100000 layers is refused now, not after building a model the machine cannot
/// hold.
fn check_sizes<R: Recipe>(args: &R, config: &ConfigOf<R>, lora: bool) -> Result<()> {
    let run = args.flags().run;
    let (flag, size) = args.input_size();
    let (what, elements) = R::Model::step_floor(config, run.batch, size);
    crate::check_footprint(&format!("--batch x {flag}"), what, elements)?;
    let params: u128 = R::Model::parameter_shapes(config)?
        .iter()
        .map(|s| s.iter().map(|&d| d as u128).product::<u128>())
        .sum();
    let (copies, what) = match lora {
        true => (1, "the memory of the parameters"),
        false => (2, "the memory of the parameters and their gradients"),
    };
    // In f32 elements, as check_footprint counts: bf16 weights take half.
    let bytes = params.checked_mul(copies * run.dtype.weights().size_in_bytes() as u128);
    crate::check_footprint(R::MODEL_FLAGS, what, bytes.map(|b| b.div_ceil(4)))
}
