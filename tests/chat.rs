//! Chat templates (`castor::chat`) against transformers' `render_jinja_template`
//! (tests/fixtures/generate_chat.py): for templates in the styles of ChatML, Llama 3, Mistral,
//! Zephyr, two with `{% generation %}` markers and one using namespace, tojson and Python's
//! string methods, over three conversations with and without the generation prompt, the
//! rendered text is transformers' exactly, the generation blocks' byte ranges are its
//! assistant indices, and a template's `raise_exception` is an error carrying its message.

use crate::common;

use castor::chat::ChatTemplate;
use common::*;
use std::collections::BTreeMap;

#[test]
fn templates_render_exactly_as_transformers_renders_them() {
    let path = root().join("tests/fixtures/chat/rendered.json");
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut compared = 0;
    for t in fixture["templates"].as_array().unwrap() {
        let name = t["name"].as_str().unwrap();
        let specials: BTreeMap<String, String> = t["specials"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
            .collect();
        let template = ChatTemplate::new(
            t["template"].as_str().unwrap().to_string(),
            name.into(),
            specials,
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        for case in t["cases"].as_array().unwrap() {
            let what = format!(
                "{name} {} add_generation_prompt={}",
                case["conversation"], case["add_generation_prompt"]
            );
            let rendered = template.render(
                &case["messages"],
                case["add_generation_prompt"].as_bool().unwrap(),
            );
            match case.get("error") {
                Some(message) => {
                    let e = format!("{:#}", rendered.err().unwrap());
                    assert!(
                        e.contains("the chat template refuses the conversation")
                            && e.contains(message.as_str().unwrap()),
                        "{what}: {e}"
                    );
                }
                None => {
                    let r = rendered.unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert_eq!(r.text, case["text"].as_str().unwrap(), "{what}");
                    let want: Vec<std::ops::Range<usize>> = case["generation"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|r| r[0].as_u64().unwrap() as usize..r[1].as_u64().unwrap() as usize)
                        .collect();
                    assert_eq!(r.generation, want, "{what}");
                }
            }
            compared += 1;
        }
    }
    assert_eq!(compared, 42);
}

#[test]
fn a_template_that_does_not_parse_names_its_file_and_line() {
    let e = ChatTemplate::new(
        "{% for m in messages %}\n{{ m.content }\n{% endfor %}".into(),
        "tokenizer_config.json".into(),
        BTreeMap::new(),
    )
    .err()
    .unwrap();
    let e = format!("{e:#}");
    assert!(
        e.contains("chat template `tokenizer_config.json`: line 2"),
        "{e}"
    );
}
