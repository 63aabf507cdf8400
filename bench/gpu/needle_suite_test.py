#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Tests of needle_suite.py's scoring and paired statistics on small hand-made result sets. No GPU,
torch or transformers needed. Usage: python3 bench/gpu/needle_suite_test.py"""
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import needle_suite as ns  # noqa: E402


def result(arm, task, target, index, score):
    return dict(arm=arm, task=task, target=target, index=index, score=score, bits_per_scalar=16.0 if arm == "dense" else 4.5)


class NeedleSuiteTest(unittest.TestCase):
    def test_import_smollm_renames_arms_and_keeps_items(self):
        item = dict(task="single", target=1024, index=50, prompt_tokens=986, score=1.0, agree=-1, bits_per_scalar=4.5,
                    prefill_s=1.0, decode_s=0.5, tokens=[1, 2], output=" 1234567.")  # fmt: skip
        rec = dict(arms={"dense": dict(items=[dict(item, bits_per_scalar=32.0)]), "tiered_k4": dict(items=[item]),
                         "fp8": dict(items=[item])})  # fmt: skip
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "tasks.json")
            json.dump(rec, open(path, "w"))
            lines = ns.from_smollm(path, {"dense": "dense", "tiered_k4": "rec"}, "CPU", "abc")
        self.assertEqual(sorted(x["arm"] for x in lines), ["dense", "rec"])  # fp8 left out
        self.assertEqual({ns.item_key(x) for x in lines}, {("single", 1024, 50)})
        self.assertEqual([x["bits_per_scalar"] for x in sorted(lines, key=lambda x: x["arm"])], [32.0, 4.5])

    def test_score_counts_answers_found(self):
        self.assertEqual(ns.score(["1234567"], "The number is 1234567."), 1.0)
        self.assertEqual(ns.score(["1111111", "2222222"], "are 2222222 and 3333333"), 0.5)
        self.assertEqual(ns.score(["1234567"], "123456"), 0.0)

    def test_paired_delta_interval_and_losses(self):
        by_arm = {"dense": {}, "rec": {}}
        for i in range(40):  # rec loses items 0-7 and gains item 39
            by_arm["dense"][("single", 1024, i)] = result("dense", "single", 1024, i, 0.0 if i == 39 else 1.0)
            by_arm["rec"][("single", 1024, i)] = result("rec", "single", 1024, i, 0.0 if i < 8 else 1.0)
        arms, keys, rows = ns.summarize_results(by_arm, boot=500)
        self.assertEqual(arms, ["dense", "rec"])
        self.assertEqual(len(keys), 40)
        overall = rows[-1]
        self.assertEqual((overall["task"], overall["length"], overall["items"]), ("all", "all", 40))
        self.assertAlmostEqual(overall["delta_rec"], -7 / 40)
        self.assertEqual((overall["lost_rec"], overall["gained_rec"]), (8, 1))
        self.assertLess(overall["ci_low_rec"], overall["delta_rec"])
        self.assertGreater(overall["ci_high_rec"], overall["delta_rec"])
        self.assertLess(overall["ci_high_rec"], 0.0)  # 8 losses against 1 gain: the interval lies below 0
        self.assertAlmostEqual(overall["acc_dense"], 39 / 40)

    def test_only_items_every_arm_scored_count(self):
        by_arm = {"dense": {("single", 1024, i): result("dense", "single", 1024, i, 1.0) for i in range(5)},
                  "rec": {("single", 1024, i): result("rec", "single", 1024, i, 1.0) for i in range(3)}}
        _, keys, rows = ns.summarize_results(by_arm, boot=100)
        self.assertEqual(len(keys), 3)
        self.assertEqual(rows[-1]["delta_rec"], 0.0)
        self.assertEqual((rows[-1]["ci_low_rec"], rows[-1]["ci_high_rec"]), (0.0, 0.0))

    def test_refusals(self):
        with self.assertRaisesRegex(ValueError, "no dense"):
            ns.summarize_results({"rec": {("single", 1024, 0): result("rec", "single", 1024, 0, 1.0)}})
        with self.assertRaisesRegex(ValueError, "no item"):
            ns.summarize_results({"dense": {("single", 1024, 0): result("dense", "single", 1024, 0, 1.0)},
                                  "rec": {("single", 1024, 1): result("rec", "single", 1024, 1, 1.0)}})

    def test_load_merges_files_later_lines_win(self):
        with tempfile.TemporaryDirectory() as d:
            a, b = os.path.join(d, "a.jsonl"), os.path.join(d, "b.jsonl")
            with open(a, "w") as f:
                f.write(json.dumps(result("dense", "single", 1024, 0, 0.0)) + "\n")
            with open(b, "w") as f:
                f.write(json.dumps(result("dense", "single", 1024, 0, 1.0)) + "\n")
                f.write(json.dumps(result("rec", "single", 1024, 0, 1.0)) + "\n")
            by_arm = ns.load_results([a, b])
            self.assertEqual(by_arm["dense"][("single", 1024, 0)]["score"], 1.0)
            self.assertEqual(set(by_arm), {"dense", "rec"})


class FakeTok:
    """A word-level tokenizer with a <bos> it adds by default and a Gemma-like chat template."""

    def __init__(self, bos=True, template=True):
        self.vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<end_of_turn>": 106}
        self.bos = bos
        self.eos_token_id = 1
        self.chat_template = "gemma-like" if template else None

    def get_vocab(self):
        return dict(self.vocab)

    def __call__(self, text, add_special_tokens=True):
        ids = [2] if add_special_tokens and self.bos else []
        for w in text.replace("\n", " \n ").split(" "):
            if w:
                ids.append(self.vocab.setdefault(w, len(self.vocab) + 200))
        return {"input_ids": ids}

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        assert add_generation_prompt and not tokenize
        return "<bos> <start_of_turn>user \n " + messages[0]["content"] + " <end_of_turn> \n <start_of_turn>model \n "


ITEM = {"kind": "niah", "task": "single", "target": 16384, "index": 0, "answers": ["1234567"],
        "user": "hay hay One of the special magic numbers for amber-falcon is: 1234567. hay\nWhat is it?",
        "answer_prefix": "The special magic number is", "prompt": [7, 8, 9], "stop": [2, 11]}


class RetokenizeTest(unittest.TestCase):
    def test_template_auto_keeps_one_bos_and_ends_with_the_prefix(self):
        tok = FakeTok()
        ids = ns.retokenize(ITEM, tok)
        self.assertEqual(ids.count(2), 1)
        self.assertEqual(ids[0], 2)
        prefix = tok(ITEM["answer_prefix"], add_special_tokens=False)["input_ids"]
        self.assertEqual(ids[-len(prefix):], prefix)
        self.assertIn(tok.vocab["1234567."], ids)

    def test_named_templates_add_the_default_bos(self):
        tok = FakeTok(template=False)
        plain = ns.retokenize(ITEM, tok, "plain")
        self.assertEqual(plain[0], 2)
        self.assertEqual(plain.count(2), 1)
        gemma = ns.retokenize(ITEM, tok, "gemma")
        self.assertEqual(gemma[:2], [2, tok.vocab["<start_of_turn>user"]])
        self.assertEqual(ns.retokenize(ITEM, FakeTok(bos=False, template=False), "plain")[0], tok.vocab["hay"])

    def test_stops_are_the_models(self):
        self.assertEqual(ns.stop_ids(FakeTok()), {1, 106})

    def test_refusals(self):
        with self.assertRaisesRegex(ValueError, "no chat template"):
            ns.retokenize(ITEM, FakeTok(template=False))
        with self.assertRaisesRegex(ValueError, "answer_prefix"):
            ns.retokenize({k: v for k, v in ITEM.items() if k != "user"}, FakeTok())


if __name__ == "__main__":
    unittest.main()
