//! `--num-labels` / `--labels`: fine-tune a checkpoint as a sequence classifier, as
//! `AutoModelForSequenceClassification.from_pretrained(path, num_labels=N)` does: a base or
//! language-model checkpoint gets a new classification head (and BERT's pooler, when the
//! checkpoint has none), initialized as transformers initializes it.

use anyhow::Result;
use castor_models::Model;
use std::path::Path;

/// The flags that turn a checkpoint into a classifier.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct ClassifierArgs {
    /// Load the model as a sequence classifier over N classes (named LABEL_0, LABEL_1, ...):
    /// a checkpoint without a classification head gets a new one (and BERT's pooler, when
    /// missing) with transformers' initialization, and its other heads go unused; a
    /// classifier checkpoint must have N labels. Saved checkpoints are the
    /// `*ForSequenceClassification` class.
    #[arg(long, value_name = "N", help_heading = "Model")]
    pub num_labels: Option<usize>,
    /// As --num-labels, naming the classes (comma-separated, in id order): labels in the data
    /// may then be these names.
    #[arg(
        long,
        value_name = "NAMES",
        value_delimiter = ',',
        conflicts_with = "num_labels",
        help_heading = "Model"
    )]
    pub labels: Vec<String>,
}

impl ClassifierArgs {
    /// The class names asked for, if any.
    pub fn names(&self) -> Option<Vec<String>> {
        match (self.num_labels, self.labels.is_empty()) {
            (Some(n), _) => Some((0..n).map(|i| format!("LABEL_{i}")).collect()),
            (None, false) => Some(self.labels.clone()),
            (None, true) => None,
        }
    }

    /// Loads the model at `path`, as a classifier when asked.
    pub fn load(&self, path: &Path) -> Result<Model> {
        Ok(match self.names() {
            Some(names) => Model::load_as_classifier(path, &names)?,
            None => Model::load(path)?,
        })
    }

    /// The config.json a checkpoint of `model` saves: `text` as written, or, for a model
    /// made a classifier by these flags, rewritten to the classifier's class and labels.
    pub fn saved_config(&self, model: &Model, text: String) -> Result<String> {
        if self.names().is_none() {
            return Ok(text);
        }
        let labels = &model.config().labels.id2label;
        castor_models::Config::classifier_json(&text, model.architecture(), labels)
            .map_err(|e| anyhow::anyhow!("`{}`: {e}", model.config().file.display()))
    }
}
