// OutputFiles (flexattn/npy.hpp): a set of output files written all or nothing. The rename of one
// temporary failing during commit() (its destination turned into a folder after add) puts back
// every file already replaced and removes every file already created; a set destroyed without
// commit() changes nothing; a committed set leaves no temporary or backup behind; a destination
// that is not a regular file is refused when it is added.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "flexattn/flexattn.hpp"

namespace flexattn {
namespace {

namespace fs = std::filesystem;

class OutputFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("flexattn_output_files_" + std::string(info->name()) + "_" +
                                        std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  void write_text(const std::string& name, const std::string& text) const {
    std::ofstream(path(name)) << text;
  }
  std::string read_text(const std::string& name) const {
    std::ifstream file(path(name));
    std::stringstream text;
    text << file.rdbuf();
    return text.str();
  }
  std::vector<std::string> files() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir_)) {
      names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  fs::path dir_;
};

HostTensor tensor_of(double value) {
  HostTensor tensor(DType::kF32, {2, 3});
  for (std::int64_t i = 0; i < tensor.numel(); ++i) tensor.set(i, value + static_cast<double>(i));
  return tensor;
}

TEST_F(OutputFilesTest, CommitWritesEveryFileAndLeavesNothingElse) {
  write_text("a.npy", "old a");
  OutputFiles outputs;
  outputs.add_npy(path("a.npy"), tensor_of(1));
  outputs.add_npy(path("b.npy"), tensor_of(10));
  outputs.add_bytes(path("c.json"), "{}");
  EXPECT_EQ(read_text("a.npy"), "old a");  // nothing changes before commit()
  EXPECT_FALSE(fs::exists(path("b.npy")));
  outputs.commit();
  EXPECT_EQ(files(), (std::vector<std::string>{"a.npy", "b.npy", "c.json"}));
  EXPECT_EQ(read_npy(path("a.npy")).at(5), 6.0);
  EXPECT_EQ(read_npy(path("b.npy")).at(0), 10.0);
  EXPECT_EQ(read_text("c.json"), "{}");
}

TEST_F(OutputFilesTest, ASetDestroyedWithoutCommitChangesNothing) {
  write_text("a.npy", "old a");
  {
    OutputFiles outputs;
    outputs.add_npy(path("a.npy"), tensor_of(1));
    outputs.add_npy(path("b.npy"), tensor_of(2));
  }
  EXPECT_EQ(files(), (std::vector<std::string>{"a.npy"}));
  EXPECT_EQ(read_text("a.npy"), "old a");
}

TEST_F(OutputFilesTest, AFailedRenamePutsBackEveryReplacedFileAndRemovesEveryCreatedOne) {
  write_text("a.npy", "old a");
  OutputFiles outputs;
  outputs.add_npy(path("a.npy"), tensor_of(1));  // replaces a file
  outputs.add_npy(path("b.npy"), tensor_of(2));  // creates one
  outputs.add_npy(path("c.npy"), tensor_of(3));  // its rename will fail
  fs::create_directory(path("c.npy"));
  try {
    outputs.commit();
    ADD_FAILURE() << "commit() succeeded onto a folder";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kIo) << error.what();
    EXPECT_NE(std::string(error.what()).find("no output changed"), std::string::npos)
        << error.what();
  }
  EXPECT_EQ(read_text("a.npy"), "old a");
  EXPECT_EQ(files(), (std::vector<std::string>{"a.npy", "c.npy"}));  // no temporary, no backup
}

TEST_F(OutputFilesTest, ANonRegularDestinationIsRefusedBeforeAnythingIsWritten) {
  OutputFiles outputs;
  outputs.add_npy(path("a.npy"), tensor_of(1));
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);  // not /dev/null: see test_cli.cpp
  try {
    outputs.add_npy(path("fifo"), tensor_of(2));
    ADD_FAILURE() << "a FIFO was accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument) << error.what();
  }
}

}  // namespace
}  // namespace flexattn
