// SPDX-License-Identifier: Apache-2.0
// Deterministic tasks: RULER-style needle-in-a-haystack (single, multi-key, multi-value,
// multi-query) over an essay-like haystack generated from word lists, perplexity over a
// licence text Debian ships, and greedy agreement with the dense arm.
#pragma once

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tokenizer.hpp"

namespace smollm {

struct niah_item {
  std::string task;  // single, multikey, multivalue, multiquery
  int target = 0;    // nominal length in tokens (1024, 2048, 4096, 8192)
  int index = 0;
  std::vector<std::int32_t> prompt;
  std::vector<std::string> answers;  // every one must appear in the output
  int max_new = 0;
  // The prompt's text before SmolLM2's chat template and tokenizer: prompt = encode(
  // chat_prompt(user) + answer_prefix). Another model re-tokenizes these with its own template
  // (bench/gpu/needle_suite.py --retokenize); the haystack is sized by SmolLM2's tokenizer.
  std::string user, answer_prefix;
};

namespace detail {

inline const std::vector<std::string>& words(int which) {
  static const std::vector<std::string> lists[] = {
      // subjects
      {"The committee", "A traveller", "The old gardener", "Our neighbour", "The engineer",
       "A young painter", "The village council", "The harbour master", "A careful reader",
       "The baker", "The museum guide", "A retired teacher", "The night watchman", "The farmer",
       "A quiet student", "The ferry captain"},
      // verbs
      {"described", "remembered", "questioned", "repaired", "admired", "studied", "carried",
       "painted", "measured", "explained", "collected", "followed", "ignored", "organised",
       "visited", "photographed"},
      // objects
      {"the narrow bridge", "an unusual clock", "the winter market", "a field of barley",
       "the stone tower", "a box of letters", "the eastern road", "an abandoned mill",
       "the public library", "a broken lantern", "the river bank", "a collection of maps",
       "the annual festival", "a wooden boat", "the city walls", "a row of chestnut trees"},
      // clauses
      {"before the first snow arrived", "while the bells were ringing",
       "after a long and dusty journey", "because nobody else had time",
       "during the quiet hours of the morning", "as the tide slowly turned",
       "without saying a single word", "in spite of the heavy rain", "when the lamps were lit",
       "long after the guests had left", "under a pale and cloudy sky", "with surprising patience",
       "near the end of the summer", "as everyone had expected", "for reasons nobody understood",
       "just before the market closed"},
      // key words (adjective, noun) for needle keys
      {"amber", "silent", "crimson", "hollow", "gentle", "frozen", "golden", "wild", "ancient",
       "bright", "velvet", "distant", "shy", "rapid", "marble", "copper"},
      {"falcon", "meadow", "harbor", "lantern", "orchard", "canyon", "willow", "comet", "garden",
       "river", "tower", "forest", "island", "valley", "beacon", "glacier"},
  };
  return lists[which];
}

template <class Rng>
const std::string& pick(Rng& rng, const std::vector<std::string>& v) {
  return v[std::uniform_int_distribution<std::size_t>(0, v.size() - 1)(rng)];
}

template <class Rng>
std::string sentence(Rng& rng) {
  std::string s = pick(rng, words(0)) + " " + pick(rng, words(1)) + " " + pick(rng, words(2)) +
                  " " + pick(rng, words(3)) + ".";
  if (std::uniform_int_distribution<int>(0, 3)(rng) == 0) s += "\n";
  return s;
}

}  // namespace detail

// Items of one task at one length; generation depends only on (seed, task, target, index).
inline niah_item make_niah_item(const tokenizer& tok, const std::string& task, int target,
                                int index, std::uint64_t seed) {
  std::seed_seq ss{std::uint32_t(seed), std::uint32_t(seed >> 32), std::uint32_t(target),
                   std::uint32_t(index), std::uint32_t(std::hash<std::string>{}(task))};
  std::mt19937_64 rng(ss);
  auto key = [&] {
    return detail::pick(rng, detail::words(4)) + "-" + detail::pick(rng, detail::words(5));
  };
  auto value = [&] {
    return std::to_string(std::uniform_int_distribution<int>(1000000, 9999999)(rng));
  };

  // Needles: (key, value); queried keys.
  std::vector<std::pair<std::string, std::string>> needles;
  std::vector<std::string> queried;
  const int n_needles = task == "single" ? 1 : 4;
  std::vector<std::string> keys;
  while (int(keys.size()) < (task == "multivalue" ? 1 : n_needles)) {
    std::string k = key();
    if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
  }
  for (int i = 0; i < n_needles; ++i) {
    std::string v;
    do {
      v = value();
    } while (std::any_of(needles.begin(), needles.end(), [&](auto& nv) { return nv.second == v; }));
    needles.push_back({task == "multivalue" ? keys[0] : keys[std::size_t(i)], v});
  }
  niah_item item;
  item.task = task;
  item.target = target;
  item.index = index;
  if (task == "single" || task == "multikey") {
    const std::size_t q =
        task == "single" ? 0 : std::uniform_int_distribution<std::size_t>(0, 3)(rng);
    queried = {needles[q].first};
    item.answers = {needles[q].second};
  } else if (task == "multivalue") {
    queried = {keys[0]};
    for (auto& nv : needles) item.answers.push_back(nv.second);
  } else {  // multiquery: two of the four keys
    std::vector<std::size_t> idx{0, 1, 2, 3};
    std::shuffle(idx.begin(), idx.end(), rng);
    queried = {needles[idx[0]].first, needles[idx[1]].first};
    item.answers = {needles[idx[0]].second, needles[idx[1]].second};
  }
  std::string question, answer_prefix;
  if (task == "single" || task == "multikey") {
    question =
        "What is the special magic number for " + queried[0] + " mentioned in the provided text?";
    answer_prefix =
        "The special magic number for " + queried[0] + " mentioned in the provided text is";
  } else if (task == "multivalue") {
    question = "What are all the special magic numbers for " + queried[0] +
               " mentioned in the provided text?";
    answer_prefix =
        "The special magic numbers for " + queried[0] + " mentioned in the provided text are";
  } else {
    question = "What are all the special magic numbers for " + queried[0] + " and " + queried[1] +
               " mentioned in the provided text?";
    answer_prefix = "The special magic numbers for " + queried[0] + " and " + queried[1] +
                    " mentioned in the provided text are";
  }
  item.max_new = task == "single" || task == "multikey" ? 16 : 48;
  item.answer_prefix = answer_prefix;

  const std::string head =
      "A special magic number is hidden within the following text. Make sure to memorize it. I "
      "will quiz you "
      "about the number afterwards.\n";
  auto build = [&](const std::vector<std::string>& hay, const std::vector<std::size_t>& at) {
    std::string body;
    std::size_t ni = 0;
    for (std::size_t s = 0; s <= hay.size(); ++s) {
      while (ni < at.size() && at[ni] == s) {
        body += " One of the special magic numbers for " + needles[ni].first +
                " is: " + needles[ni].second + ".";
        ++ni;
      }
      if (s < hay.size()) body += " " + hay[s];
    }
    item.user = head + body + "\n" + question;
    return tok.encode(chat_prompt(item.user) + answer_prefix);
  };
  // Grow the haystack sentence by sentence (token counts are additive to a few tokens),
  // then trim until the whole prompt plus the answer fits the target.
  const int budget = target - item.max_new - 16;
  std::vector<std::string> hay;
  int approx = int(build({}, {}).size());
  while (approx < budget) {
    hay.push_back(detail::sentence(rng));
    approx += int(tok.encode(" " + hay.back(), false).size());
  }
  std::vector<std::size_t> at(needles.size());
  auto place = [&] {
    for (auto& a : at) a = std::uniform_int_distribution<std::size_t>(0, hay.size())(rng);
    std::sort(at.begin(), at.end());
  };
  place();
  item.prompt = build(hay, at);
  while (int(item.prompt.size()) > budget && !hay.empty()) {
    const int over = int(item.prompt.size()) - budget;
    const std::size_t drop = std::max<std::size_t>(1, std::size_t(over / 14));
    hay.resize(hay.size() - std::min(drop, hay.size()));
    for (auto& a : at) a = std::min(a, hay.size());
    item.prompt = build(hay, at);
  }
  return item;
}

// Every answer string appears in the output.
inline double niah_score(const niah_item& item, const std::string& output) {
  int found = 0;
  for (const auto& a : item.answers) found += output.find(a) != std::string::npos ? 1 : 0;
  return double(found) / double(item.answers.size());
}

inline std::string read_text_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace smollm
